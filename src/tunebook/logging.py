"""Main-process logging, `metrics.jsonl`, throughput counters and `summary.json`."""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "MetricsWriter",
    "RunTimer",
    "data_wait_advice",
    "peak_rss_mb",
    "setup_logging",
    "versions",
    "write_summary",
]

logger = logging.getLogger("tunebook")


def setup_logging(is_main_process: bool, level: str = "INFO") -> logging.Logger:
    """One format for Tunebook and the libraries; only the main process logs below WARNING."""
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", stream=sys.stdout, force=True
    )
    logger.setLevel(level if is_main_process else "WARNING")
    import datasets
    import transformers

    if not is_main_process:
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    return logger


class MetricsWriter:
    """Append one JSON object per call to `output_dir/metrics.jsonl` (main process only)."""

    def __init__(self, path: str | Path, enabled: bool, resume_step: int | None = None, accelerator=None):
        """A fresh file, or with `resume_step` the existing one cut after that step's records.

        With `accelerator`, every record also goes to its trackers (`tunebook.trackers.tracker_values`).

        A run resumed from the checkpoint of step N continues at N + 1, so what an interrupted run logged after
        its last checkpoint is dropped: no step is missing or logged twice.
        """
        self.path = Path(path)
        self.enabled = enabled
        self.accelerator = accelerator
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if resume_step is not None and self.path.is_file():
                for line in self.path.read_text().splitlines():
                    try:
                        if json.loads(line)["step"] <= resume_step:
                            kept.append(line + "\n")
                    except (ValueError, KeyError):  # a line cut short by the crash
                        continue
            self.path.write_text("".join(kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(_jsonable(record)) + "\n")
            if self.accelerator is not None and self.accelerator.trackers:
                from .trackers import tracker_values

                self.accelerator.log(tracker_values(_jsonable(record)), step=record["step"])


class RunTimer:
    """Wall-clock bookkeeping of a training run.

    Time since process start to the first optimizer step; training time that excludes evaluation and
    checkpointing inside the loop (`paused()`); the time the loop waited for its next batch (`add_data_wait`);
    and, per logging window, tokens/s and the share of the window spent waiting for data.
    """

    def __init__(self):
        self.process_start = _process_start_time()
        self.train_start: float | None = None
        self.first_step_done: float | None = None
        self.paused_seconds = 0.0
        self.data_wait_seconds = 0.0
        self._mark = (time.perf_counter(), 0, 0.0, 0.0)  # time, tokens, paused, data wait at the last window

    def start_training(self) -> None:
        self.train_start = time.perf_counter()
        self._mark = (self.train_start, 0, self.paused_seconds, self.data_wait_seconds)

    def step_done(self) -> None:
        if self.first_step_done is None:
            self.first_step_done = time.time()

    def add_data_wait(self, seconds: float) -> None:
        self.data_wait_seconds += seconds

    @contextmanager
    def paused(self):
        """Time inside this block (evaluation, checkpoint saves) does not count as training time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_seconds += time.perf_counter() - start

    def window(self, tokens_total: int) -> dict[str, float]:
        """`tokens_per_second` and `data_wait_fraction` since the previous call (or the start of training)."""
        now = time.perf_counter()
        then, tokens, paused, waited = self._mark
        busy = max(now - then - (self.paused_seconds - paused), 1e-9)
        self._mark = (now, tokens_total, self.paused_seconds, self.data_wait_seconds)
        return {
            "tokens_per_second": (tokens_total - tokens) / busy,
            "data_wait_fraction": min((self.data_wait_seconds - waited) / busy, 1.0),
        }

    @property
    def time_to_first_step(self) -> float | None:
        return None if self.first_step_done is None else self.first_step_done - self.process_start

    def train_runtime(self) -> float:
        if self.train_start is None:
            return 0.0
        return time.perf_counter() - self.train_start - self.paused_seconds

    def data_wait_fraction(self) -> float:
        runtime = self.train_runtime()
        return min(self.data_wait_seconds / runtime, 1.0) if runtime > 0 else 0.0


def data_wait_advice(fraction: float, num_workers: int, prefetch_factor: int, threshold: float = 0.05) -> str | None:
    """What to change when the training loop waited for data more than `threshold` of its time, else None."""
    if fraction <= threshold:
        return None
    if num_workers == 0:
        fix = "set dataloader_num_workers (now 0) to 2 or more so batches are collated in the background"
    else:
        fix = f"raise dataloader_num_workers (now {num_workers}) or dataloader_prefetch_factor (now {prefetch_factor})"
    return (
        f"The training loop waited for data {100 * fraction:.0f}% of the time (more than {100 * threshold:.0f}%): "
        f"{fix}; prepare the data ahead with `tunebook prepare` if preprocessing is the slow part"
    )


def _process_start_time() -> float:
    try:
        import psutil

        return psutil.Process(os.getpid()).create_time()
    except Exception:  # psutil missing or /proc unreadable: fall back to import time
        return time.time()


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if platform.system() == "Darwin" else rss / 1024


def versions() -> dict[str, str]:
    import accelerate
    import datasets
    import torch
    import transformers

    from . import __version__

    return {
        "tunebook": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "datasets": datasets.__version__,
        "python": platform.python_version(),
    }


def write_summary(path: str | Path, summary: dict[str, Any]) -> None:
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_jsonable(summary), indent=2) + "\n")
    tmp.replace(path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    return value
