"""Logging (one format, each message once), progress bars, `metrics.jsonl`, run timing and `summary.json`."""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "PlainFormatter",
    "describe_processes",
    "log_run_start",
    "setup_logging",
    "show_heartbeat",
    "show_progress",
    "strip_ansi",
]

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
    handler.setFormatter(PlainFormatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
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
    # transformers writes its records to stderr through a handler of its own, in its own format and with its colours
    # (its "LOAD REPORT"); through ours they get the run's format, the other ranks' filter and no escape codes.
    transformers.utils.logging.disable_default_handler()
    transformers.utils.logging.enable_propagation()
    if not is_main_process:
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
    if not is_main_process or disable_tqdm or not sys.stderr.isatty():
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    return logger


# ANSI escape sequences: CSI (colours, cursor moves: ESC [ ... final byte) and OSC (titles, links: ESC ] ... BEL/ST).
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")


def strip_ansi(text: str) -> str:
    """`text` without terminal escape sequences (a library's colours), as a log file should hold it."""
    return _ANSI.sub("", text)


class PlainFormatter(logging.Formatter):
    """A `logging.Formatter` whose lines never hold terminal escape codes: the run's log is usually a file (`> run.log
    2>&1`, a job's output), where a library's colours would be raw `\x1b[1m` bytes."""

    def format(self, record: logging.LogRecord) -> str:
        return strip_ansi(super().format(record))


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


def show_heartbeat(
    progress, step: int, total_steps: int, figures: dict[str, str], log: logging.Logger = logger
) -> None:
    """A timed progress line between logging steps (`tunebook.training.throughput.Heartbeat`): a log line, or the
    progress bar's figures where a bar shows (its own elapsed time and ETA are on it)."""
    if progress.disable:
        log.info("Step %d/%d: %s", step, total_steps, ", ".join(f"{k} {v}" for k, v in figures.items()))
    else:
        progress.set_postfix({"loss so far": figures["loss so far"]})


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
    log.info("Launch: %s on %s, %s", _describe_accelerator(accelerator), str(accelerator.device).split(":")[0],  # "cpu", "cuda"
             "no mixed precision" if accelerator.mixed_precision == "no" else f"{accelerator.mixed_precision} mixed precision")  # fmt: skip


def _describe_accelerator(accelerator) -> str:
    state = getattr(accelerator, "state", None)  # a test's stand-in may have none
    deepspeed = getattr(state, "deepspeed_plugin", None)
    fsdp = getattr(state, "fsdp_plugin", None)
    return describe_processes(
        accelerator.distributed_type.value,
        accelerator.num_processes,
        zero_stage=getattr(deepspeed, "zero_stage", None),
        fsdp_version=getattr(fsdp, "fsdp_version", None),
    )


# Accelerate's names of the distributed setups (`DistributedType`) in the words the docs use; MULTI_<device> is DDP.
_SETUPS = {"MULTI_CPU": "DDP on CPUs", "FSDP": "FSDP", "XLA": "XLA", "MEGATRON_LM": "Megatron-LM"}


def describe_processes(
    distributed_type: str, num_processes: int, zero_stage: int | None = None, fsdp_version: int | None = None
) -> str:
    """accelerate's `DistributedType` name and process count in words: "single process", "DDP, 4 processes",
    "FSDP, 8 processes", "DeepSpeed ZeRO-3, 8 processes", "DDP on CPUs, 2 processes"."""
    if distributed_type == "NO":
        return "single process" if num_processes == 1 else f"{num_processes} processes, no process group"
    if distributed_type == "DEEPSPEED":
        setup = "DeepSpeed" if zero_stage is None else f"DeepSpeed ZeRO-{zero_stage}"
    elif distributed_type == "FSDP" and fsdp_version == 2:
        setup = "FSDP2"
    elif distributed_type.startswith("MULTI_") and distributed_type != "MULTI_CPU":
        setup = "DDP"
    else:
        setup = _SETUPS.get(distributed_type, distributed_type)
    return f"{setup}, {num_processes} process{'' if num_processes == 1 else 'es'}"
