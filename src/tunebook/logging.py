"""Logging (one format, each message once), progress bars, `metrics.jsonl`, run timing and `summary.json`."""

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
    "log_run_start",
    "MetricsWriter",
    "RunTimer",
    "data_wait_advice",
    "peak_rss_mb",
    "progress_bar",
    "setup_logging",
    "show_progress",
    "versions",
    "write_summary",
]

logger = logging.getLogger("tunebook")


def setup_logging(is_main_process: bool, level: str = "INFO", disable_tqdm: bool = False) -> logging.Logger:
    """One format for Tunebook, the libraries and Python warnings; each message once, not once per process.

    The main process logs at `level`. Every process runs the same code and would repeat the same warnings, so
    the others keep only errors and records logged with `extra={"all_ranks": True}`, prefixed with their rank.
    Progress bars of datasets and transformers (data preparation, weight loading) show on the main process only,
    and not at all with `disable_tqdm` or when stderr is not a terminal (a log file, CI).
    """
    import datasets
    import transformers

    rank = os.environ.get("RANK", "0")
    prefix = "" if is_main_process else f"[rank {rank}] "
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    if not is_main_process:
        handler.addFilter(_OtherRanksFilter())
    logging.basicConfig(handlers=[handler], force=True)
    # warnings.warn goes through the handler and its filter too. Off first: captureWarnings(True) does nothing when an
    # earlier run in this process (a notebook's second run) captured already and warnings.showwarning was reset since.
    logging.captureWarnings(False)
    logging.captureWarnings(True)
    logger.setLevel(level if is_main_process else "WARNING")
    if not is_main_process:
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
    # Tied embeddings are one tensor saved once: accelerate warns about it at every checkpoint, and resuming from
    # them is tested exact (tests/equivalence/test_resume.py).
    logging.getLogger("accelerate.utils.other").addFilter(_SharedTensorNote())
    if not is_main_process or disable_tqdm or not sys.stderr.isatty():
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    return logger


class _SharedTensorNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Removed shared tensor")


class _OtherRanksFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or getattr(record, "all_ranks", False)


def progress_bar(main_process: bool, disable: bool, **kwargs):
    """A tqdm bar on the main process only; off with `disable` (disable_tqdm) and when stderr is not a terminal."""
    from tqdm.auto import tqdm

    # tqdm's disable=None means: off when the output is not a TTY.
    return tqdm(disable=True if disable or not main_process else None, dynamic_ncols=True, **kwargs)


def show_progress(progress, record: dict[str, Any], total_steps: int, log: logging.Logger = logger) -> None:
    """A logging step's figures in the progress bar, or as a log line when there is no bar (CI, files, workers)."""
    loss = record["loss"]
    shown = {"loss": "skipped" if loss is None else f"{loss:.4f}", "lr": f"{record['learning_rate']:.2e}"}
    shown["tok/s"] = f"{record['tokens_per_second']:,.0f}"
    if "mfu" in record:
        shown["mfu"] = f"{100 * record['mfu']:.1f}%"
    if progress.disable:
        log.info("Step %d/%d: %s", record["step"], total_steps, ", ".join(f"{k} {v}" for k, v in shown.items()))
    else:
        progress.set_postfix(shown, refresh=False)


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
    and, per logging window, the training time and data wait that `tunebook.training.Throughput` turns into rates.
    """

    def __init__(self):
        self.process_start = _process_start_time()
        self.train_start: float | None = None
        self.first_step_done: float | None = None
        self.paused_seconds = 0.0
        self.data_wait_seconds = 0.0
        self._mark = (time.perf_counter(), 0.0, 0.0)  # time, paused and data wait at the last window

    def start_training(self) -> None:
        self.train_start = time.perf_counter()
        self._mark = (self.train_start, self.paused_seconds, self.data_wait_seconds)

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

    def window(self) -> tuple[float, float]:
        """(training seconds, seconds waited for data) since the previous call or the start of training."""
        now = time.perf_counter()
        then, paused, waited = self._mark
        self._mark = (now, self.paused_seconds, self.data_wait_seconds)
        return max(now - then - (self.paused_seconds - paused), 1e-9), self.data_wait_seconds - waited

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


def data_wait_advice(
    fraction: float, num_workers: int, prefetch_factor: int, threshold: float = 0.05, data_built: bool = False
) -> str | None:
    """What to change when the training loop waited for data more than `threshold` of its time, else None.
    `data_built`: this run tokenised its data (rather than finding every cache built)."""
    if fraction <= threshold:
        return None
    if num_workers == 0:
        fix = "set dataloader_num_workers (now 0) to 2 or more so batches are collated in the background"
    else:
        fix = f"raise dataloader_num_workers (now {num_workers}) or dataloader_prefetch_factor (now {prefetch_factor})"
    prepare = (
        "; prepare the data ahead with `tunebook prepare` if preprocessing is the slow part" if data_built else ""
    )
    return f"The training loop waited for data {100 * fraction:.0f}% of the time (more than {100 * threshold:.0f}%): {fix}{prepare}"


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


def log_run_start(log: logging.Logger, config, accelerator) -> None:
    """The resolved config, the other tools' key names it was given with (once each), and the processes."""
    from .config import aliases_used, config_to_dict

    # One line of what differs from the recipe's defaults: the whole resolved config is in output_dir/config.yaml.
    defaults = config_to_dict(type(config)())
    changed = {k: v for k, v in config_to_dict(config).items() if defaults.get(k) != v and k != "cache_dir"}
    shown = ", ".join(f"{k}={v!r}" for k, v in changed.items()) or "the recipe's defaults"
    log.info("Config: %s (every key: %s)", shown, Path(config.output_dir) / "config.yaml")
    for alias, key in aliases_used(config).items():
        log.info("Config key '%s' (TRL's / transformers' name) is read as '%s'", alias, key)
    log.info(
        "%d process(es), %s, device %s, mixed precision %s",
        accelerator.num_processes,
        accelerator.distributed_type.value,
        accelerator.device,
        accelerator.mixed_precision,
    )
