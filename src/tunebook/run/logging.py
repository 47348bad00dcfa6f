"""Logging (one format, each message once), progress bars, `metrics.jsonl`, run timing and `summary.json`."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["log_run_start", "setup_logging", "show_progress"]

logger = logging.getLogger("tunebook")


def setup_logging(
    is_main_process: bool, level: str = "INFO", disable_tqdm: bool = False, whole_process: bool | None = None
) -> logging.Logger:
    """One format for Tunebook, the libraries and Python warnings; each message once, not once per process.

    The main process logs at `level`. Every process runs the same code and would repeat the same warnings, so
    the others keep only errors and records logged with `extra={"all_ranks": True}`, prefixed with their rank.
    Progress bars of datasets and transformers (data preparation, weight loading) show on the main process only,
    and not at all with `disable_tqdm` or when stderr is not a terminal (a log file, CI).

    All of that is process-wide (the root logger, `warnings`, the libraries' verbosity and bars), so it is done only
    where the process is the run's: `whole_process` (by default, a Tunebook command's process: `owns_process()`), and
    every process other than the main one, which exists for the run. A caller's own interpreter (a notebook's
    `main(config)`) gets the format on Tunebook's own logger only, and keeps its root logger, warnings and libraries.
    """
    import datasets
    import transformers

    from ..errors import owns_process

    whole_process = (owns_process() if whole_process is None else whole_process) or not is_main_process
    rank = os.environ.get("RANK", "0")
    prefix = "" if is_main_process else f"[rank {rank}] "
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    if not is_main_process:
        handler.addFilter(_OtherRanksFilter())
    for old in [h for h in logger.handlers if getattr(h, "tunebook", False)]:  # an earlier run's, in this process
        logger.removeHandler(old)
    logger.setLevel(level if is_main_process else "WARNING")
    if not whole_process:
        handler.tunebook = True
        logger.addHandler(handler)
        return logger
    logging.basicConfig(handlers=[handler], force=True)
    # warnings.warn goes through the handler and its filter too. Off first: captureWarnings(True) does nothing when an
    # earlier run in this process (a notebook's second run) captured already and warnings.showwarning was reset since.
    logging.captureWarnings(False)
    logging.captureWarnings(True)
    if not is_main_process:
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
    # Tied embeddings are one tensor saved once: accelerate warns about it at every checkpoint, and resuming from
    # them is tested exact (tests/equivalence/test_resume.py).
    accelerate_logger = logging.getLogger("accelerate.utils.other")
    if not any(isinstance(f, _SharedTensorNote) for f in accelerate_logger.filters):  # once, not once per run
        accelerate_logger.addFilter(_SharedTensorNote())
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


def log_run_start(log: logging.Logger, config, accelerator) -> None:
    """The resolved config, the other tools' key names it was given with (once each), and the processes."""
    from ..config import aliases_used, config_to_dict

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
