"""Where a run starts: a fresh output directory, or a checkpoint resumed exactly, with the config it was run with.

A resumed run continues the computation its checkpoint was part of, so the keys that decide that computation (the
data and its order, the batches, the model, the seed, the number of processes) must be what they were: a change
stops the run with one line naming the keys. Keys of the run's control (logging, evaluation and save cadence,
`max_steps`/epochs to extend the run, early stopping, loaders, trackers) are simply the new config's. The optimizer
keys (learning rate and schedule, weight decay, Adam's betas and epsilon, clipping) are applied from the step the
run resumes at: the schedule is the new config's over the new total number of steps, from where it was.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import yaml

from ..checkpoint import (
    checkpoint_path,
    list_checkpoints,
    load_process_state,
    load_trainer_state,
    resolve_checkpoint,
    save_checkpoint,
)
from ..config import config_to_dict
from ..errors import ConfigError

__all__ = ["RUN_CONTROL_KEYS", "OPTIMIZER_KEYS", "prepare_output_dir", "resume_training", "save_training_state"]

# Keys a resumed run may change: they decide when things happen and where outputs go, not what is computed.
RUN_CONTROL_KEYS = frozenset(
    {
        "output_dir", "cache_dir", "resume_from_checkpoint", "overwrite_output_dir", "max_steps", "num_train_epochs",
        "logging_steps", "eval_strategy", "eval_steps", "eval_on_start", "save_strategy", "save_steps",
        "save_total_limit", "early_stopping_patience", "load_best_model_at_end", "report_to", "disable_tqdm",
        "log_level", "preflight_timeout", "ddp_timeout", "dataloader_num_workers", "dataloader_prefetch_factor",
        "dataloader_pin_memory", "dataloader_non_blocking", "dataset_num_proc", "peak_flops", "nan_policy",
        "per_device_eval_batch_size", "eval_data", "generation_eval", "generation_max_new_tokens",
        "generation_eval_max_samples", "metrics", "metric_average", "push_to_hub", "hub_model_id", "hub_private_repo",
        "merge_adapter", "trust_remote_code",
    }
)  # fmt: skip
# Keys applied to the optimizer and the schedule from the step the run resumes at.
OPTIMIZER_KEYS = frozenset(
    {"learning_rate", "lr_scheduler_type", "warmup_ratio", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
     "max_grad_norm"}
)  # fmt: skip
# Files a run writes into output_dir besides the model: another run's are removed by overwrite_output_dir.
RUN_FILES = ("checkpoints", "runs", "metrics.jsonl", "summary.json", "report.png")


def prepare_output_dir(accelerator, config, log: logging.Logger) -> None:
    """A fresh run (no `resume_from_checkpoint`) into an output_dir that holds checkpoints would mix two runs
    (`latest` would later resume the old one): stop, unless `overwrite_output_dir` asks to delete them."""
    output_dir = Path(config.output_dir)
    found = list_checkpoints(output_dir)
    if config.resume_from_checkpoint is not None or not found:
        return
    if not config.overwrite_output_dir:
        raise ConfigError(
            f"output_dir {output_dir} holds checkpoints of an earlier run (newest: {found[-1].name}); continue it with "
            "--resume_from_checkpoint latest, or start over with --overwrite_output_dir true (deletes them)"
        )
    if accelerator.is_main_process:
        for name in RUN_FILES:
            path = output_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        log.warning("overwrite_output_dir: deleted the earlier run's checkpoints and logs in %s", output_dir)
    accelerator.wait_for_everyone()


def save_training_state(
    accelerator,
    output_dir,
    step: int,
    config,
    state: dict[str, Any],
    tokenizer,
    counters,
    best,
    figures,
    recipe,
    data: dict[str, Any] | None = None,
) -> Path:
    """A recipe's checkpoint at optimizer step `step`: the loop's `state` (`RunState`), this process's `counters`,
    logged `figures` and streamed `data` position, and the `best` model tracker, whose checkpoint, if this is it, is
    recorded and protected from rotation."""
    if best is not None and best.best_step == step:
        best.best_checkpoint = str(checkpoint_path(output_dir, step))
    shared = {**state, "best": best.state_dict() if best is not None else None}
    process = {**counters.state_dict(), "figures": figures.state_dict(), **({"data": data} if data else {})}
    return save_checkpoint(
        accelerator, output_dir, step, config, shared, config.save_total_limit, tokenizer, process,
        best.best_checkpoint if best is not None else None, recipe,
    )  # fmt: skip


def resume_training(accelerator, config, counters, best, figures, log: logging.Logger, optimizer, lr_scheduler,
                    stream=None):  # fmt: skip
    """Continue from `config.resume_from_checkpoint` ('latest', 'auto', a path; None: a fresh start).

    Restores what `accelerator.save_state` saved (model, optimizer, scheduler, RNG states), this process's
    `counters`, `figures` and `stream` position (a `StreamLoader`, or None), and the `best` tracker, after checking the config against the checkpoint's; changed
    optimizer keys are applied to the prepared `optimizer` and `lr_scheduler`. Returns
    (checkpoint or None, the trainer state: global_step, epoch, batches_in_epoch, ...).
    """
    spec = config.resume_from_checkpoint
    checkpoint = resolve_checkpoint(config.output_dir, spec) if spec else None
    if checkpoint is None:
        if spec == "auto":
            log.info("resume_from_checkpoint auto: no checkpoint in %s yet, starting from scratch", config.output_dir)
        return None, {}
    optimizer_changes = check_resumed_config(config, checkpoint, accelerator.num_processes)
    if accelerator._custom_objects and not any(Path(checkpoint).glob("custom_checkpoint_*")):
        # Only the schedule is registered (loop.plan_training, under DeepSpeed); Accelerate would raise a traceback.
        raise ConfigError(
            f"{checkpoint} holds no learning-rate schedule: it was written under DeepSpeed by a Tunebook that left "
            "the schedule out, and a resumed run would restart it. Start a new run"
        )
    accelerator.load_state(str(checkpoint))
    state = load_trainer_state(checkpoint)
    process = load_process_state(checkpoint, accelerator.process_index)
    counters.load_state_dict(process)
    if process.get("figures"):
        figures.load_state_dict(process["figures"])
    if stream is not None:  # a stream continues from its saved position (tunebook.data.streaming), not by skipping
        stream.load_state_dict(process["data"])
    if best is not None and state.get("best"):
        best.load_state_dict(state["best"])
    if optimizer_changes:
        _apply_optimizer_config(config, optimizer, lr_scheduler)
        log.warning("Resumed with changed optimizer settings, applied from step %d on: %s", state["global_step"],
                    ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in optimizer_changes.items()))  # fmt: skip
    return checkpoint, state


def check_resumed_config(config, checkpoint: Path, num_processes: int) -> dict[str, tuple[Any, Any]]:
    """Refuse what would make a resumed run compute something else; return the changed optimizer keys."""
    saved = yaml.safe_load((checkpoint / "config.yaml").read_text()) or {}
    now = config_to_dict(config)
    changed = {k: (saved.get(k), v) for k, v in now.items() if k in saved and saved[k] != v}
    breaking = sorted(k for k in changed if k not in RUN_CONTROL_KEYS | OPTIMIZER_KEYS)
    saved_processes = len(list(checkpoint.glob("process_state_*.json")))
    if saved_processes and saved_processes != num_processes:
        breaking.append(f"the number of processes ({saved_processes} -> {num_processes})")
    if breaking:
        raise ConfigError(
            f"resume_from_checkpoint {checkpoint}: the run was started with other values of {', '.join(breaking)}; "
            "resuming would not continue the same computation. Use the checkpoint's values (its config.yaml), or "
            "start a new run in another output_dir"
        )
    return {k: v for k, v in changed.items() if k in OPTIMIZER_KEYS}


def _apply_optimizer_config(config, optimizer, lr_scheduler) -> None:
    """Optimizer hyperparameters from `config` after `load_state` restored the checkpoint's (the schedule's shape
    and length already come from the config: its multiplier functions are not saved, only its step)."""
    schedule = getattr(lr_scheduler, "scheduler", lr_scheduler)  # Accelerate's wrapper holds the LambdaLR
    schedule.base_lrs = [config.learning_rate for _ in schedule.base_lrs]
    for group, multiplier in zip(optimizer.param_groups, schedule.lr_lambdas):
        group["lr"] = config.learning_rate * multiplier(schedule.last_epoch)
    schedule._last_lr = [group["lr"] for group in optimizer.param_groups]
    for index, group in enumerate(optimizer.param_groups):
        group["betas"], group["eps"] = (config.adam_beta1, config.adam_beta2), config.adam_epsilon
        if index == 0:  # the decayed matrices (build_optimizer): biases and norms never decay
            group["weight_decay"] = config.weight_decay
