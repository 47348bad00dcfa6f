"""The summary of a training run: what `summary.json` holds and `main(config)` returns, the same for every recipe."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from .logging import data_wait_advice, peak_rss_mb, versions

__all__ = ["run_summary"]

logger = logging.getLogger("tunebook")


def run_summary(
    recipe: str,
    config,
    accelerator,
    throughput,
    data,
    timer,
    counters,
    best,
    *,
    global_step: int,
    final_train_loss: float | None,
    final_eval: dict[str, Any],
    eval_before: dict[str, Any],
    skipped_updates: int,
    resumed_from,
    stopped_early: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """Everything a run reports, totalled over all processes; call it on every process (it reduces across them).

    `throughput` is the run's `Throughput` (FLOPs per token, device peak), `timer` its `RunTimer`, `counters` its
    `TrainCounters` (tokens and examples seen, tokens fed), `best` its `BestModel` or None, `data` the prepared
    data (its `seconds` and `stats`). `extra` adds recipe-specific keys. Logs the data-loading advice when the loop
    waited for data.
    """
    train_runtime = timer.train_runtime()
    totals = torch.stack([counters.tokens_seen, counters.fed_tokens, counters.samples_seen])
    tokens, fed, samples = accelerator.reduce(totals, "sum").tolist()
    local_wait = torch.tensor(timer.data_wait_fraction(), device=accelerator.device)
    data_wait = accelerator.reduce(local_wait, "mean").item()
    workers, prefetch = config.dataloader_num_workers, config.dataloader_prefetch_factor
    if advice := data_wait_advice(data_wait, workers, prefetch, data_built=bool(getattr(data, "built", []))):
        logger.warning(advice)
    summary = {
        "recipe": recipe,
        "train_steps": global_step,
        "train_tokens": int(tokens),
        "train_runtime_seconds": train_runtime,
        "train_tokens_per_second": tokens / train_runtime if train_runtime > 0 else 0.0,
        "train_samples": int(samples),
        "train_samples_per_second": samples / train_runtime if train_runtime > 0 else 0.0,
        "time_to_first_step_seconds": timer.time_to_first_step,
        "data_prep_seconds": data.seconds,
        "data_wait_fraction": data_wait,
        "final_train_loss": final_train_loss,
        "eval": final_eval,
        "eval_before_training": eval_before,
        "best": best.state_dict() if best else None,
        "stopped_early": stopped_early,
        "skipped_updates": skipped_updates,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "padding_fraction": 1 - tokens / fed if fed else 0.0,
        "packing_efficiency": tokens / fed if getattr(config, "packing", False) and fed else None,
        **extra,
        "data": data.stats,
        "peak_rss_mb": peak_rss_mb(),  # host memory, on a GPU too
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "versions": versions(),
        "output_dir": str(Path(config.output_dir)),
    }
    # model FLOPs per token, MFU (GPUs of known peak, or peak_flops), peak memory
    summary.update(throughput.summary(summary["train_tokens_per_second"]))
    return summary
