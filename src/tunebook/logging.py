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
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter", "RunTimer", "peak_rss_mb", "setup_logging", "versions", "write_summary"]

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

    def __init__(self, path: str | Path, enabled: bool):
        self.path = Path(path)
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(_jsonable(record)) + "\n")


class RunTimer:
    """Wall-clock bookkeeping: time since process start, first step, and tokens/s between log points."""

    def __init__(self):
        self.process_start = _process_start_time()
        self.train_start: float | None = None
        self.first_step_done: float | None = None
        self._mark_time = time.perf_counter()
        self._mark_tokens = 0

    def start_training(self) -> None:
        self.train_start = time.time()
        self._mark_time = time.perf_counter()

    def step_done(self) -> None:
        if self.first_step_done is None:
            self.first_step_done = time.time()

    def rate_since_mark(self, tokens_total: int) -> float:
        """Tokens/s since the previous call (or the start of training)."""
        now = time.perf_counter()
        rate = (tokens_total - self._mark_tokens) / max(now - self._mark_time, 1e-9)
        self._mark_time, self._mark_tokens = now, tokens_total
        return rate

    @property
    def time_to_first_step(self) -> float | None:
        return None if self.first_step_done is None else self.first_step_done - self.process_start

    def train_runtime(self) -> float:
        return 0.0 if self.train_start is None else time.time() - self.train_start


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
