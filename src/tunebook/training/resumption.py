"""Where a run starts: a fresh output directory, or a checkpoint resumed exactly, with the config it was run with.

A resumed run continues the computation its checkpoint was part of, so the keys that decide that computation (the
data and its order, the batches, the model, the seed, the number of processes) must be what they were: a change
stops the run with one line naming the keys. Keys of the run's control (logging, evaluation and save cadence,
`max_steps`/epochs to extend the run, early stopping, loaders, trackers) are simply the new config's. The optimizer
keys (learning rate and schedule, weight decay, Adam's betas and epsilon, clipping) are applied from the step the
run resumes at: the schedule is the new config's over the new total number of steps, from where it was.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import yaml

from .. import compat
from ..config import check_output_dir, config_to_dict
from ..distributed import decided_by_main
from ..errors import ConfigError, TrainingError, TunebookError, first_line, same_on_every_rank
from .checkpoint import (
    SCHEDULE,
    checkpoint_path,
    list_checkpoints,
    load_process_state,
    load_trainer_state,
    resolve_checkpoint,
    save_checkpoint,
)

__all__ = [
    "RUN_CONTROL_KEYS",
    "OPTIMIZER_KEYS",
    "load_rng_state",
    "load_schedule",
    "prepare_output_dir",
    "resume_training",
    "save_training_state",
    "schedule_state",
]

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
        "merge_adapter", "trust_remote_code", "sample_prompts", "sample_max_new_tokens",
        # lm-evaluation-harness: it reads the model and leaves training as it was (random states, mode)
        "eval_harness_tasks", "eval_harness_limit", "eval_harness_num_fewshot", "eval_harness_at_eval",
        "eval_harness_chat_template", "eval_harness_batch_size",
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
    (`latest` would later resume the old one): stop (`check_output_dir`, checked again under the run's lock), unless
    `overwrite_output_dir` asks to delete them."""
    check_output_dir(config)
    output_dir = Path(config.output_dir)
    if config.resume_from_checkpoint is not None or not list_checkpoints(output_dir):
        return
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
    lr_scheduler=None,
    registered: dict[str, Any] | None = None,
) -> Path:
    """A recipe's checkpoint at optimizer step `step`: the loop's `state` (`RunState`), this process's `counters`,
    logged `figures`, streamed `data` position and `registered` objects (by name), and the `best` model tracker, whose
    checkpoint, if this is it, is recorded and protected from rotation; the `lr_scheduler`'s state where Accelerate
    leaves it out (DeepSpeed)."""
    if best is not None and best.best_step == step:
        best.best_checkpoint = str(checkpoint_path(output_dir, step))
    shared = {**state, "best": best.state_dict() if best is not None else None}
    process = {**counters.state_dict(), "figures": figures.state_dict(), **({"data": data} if data else {})}
    process.update({name: thing.state_dict() for name, thing in (registered or {}).items()})
    return save_checkpoint(
        accelerator, output_dir, step, config, shared, config.save_total_limit, tokenizer, process,
        best.best_checkpoint if best is not None else None, recipe, schedule_state(accelerator, lr_scheduler),
    )  # fmt: skip


def resume_training(accelerator, config, counters, best, figures, log: logging.Logger, optimizer, lr_scheduler,
                    stream=None, registered: dict[str, Any] | None = None):  # fmt: skip
    """Continue from `config.resume_from_checkpoint` ('latest', 'auto', a path; None: a fresh start).

    Restores what `accelerator.save_state` saved (model, optimizer, scheduler, RNG states), this process's
    `counters`, `figures`, `stream` position (a `StreamLoader`, or None) and `registered` objects (by name), and the
    `best` tracker, after checking the config against the checkpoint's; changed
    optimizer keys are applied to the prepared `optimizer` and `lr_scheduler`. The checkpoint is verified first, on
    the main process (`resolve_checkpoint`: `latest` falls back past damaged ones), and loading it either restores
    everything, random number generators included, or stops every process with one line. Returns
    (checkpoint or None, the trainer state: global_step, epoch, batches_in_epoch, ...).
    """
    spec = config.resume_from_checkpoint
    checkpoint = None
    if spec:  # verified on the main process, the choice the same on all
        checkpoint = decided_by_main(accelerator, lambda: resolve_checkpoint(config.output_dir, spec, log))
    if checkpoint is None:
        if spec == "auto":
            log.info("resume_from_checkpoint auto: no checkpoint in %s yet, starting from scratch", config.output_dir)
        return None, {}
    optimizer_changes = check_resumed_config(config, checkpoint, accelerator.num_processes)
    state, process = _load_checkpoint(accelerator, checkpoint, lr_scheduler)
    counters.load_state_dict(process)
    if process.get("figures"):
        figures.load_state_dict(process["figures"])
    if stream is not None:  # a stream continues from its saved position (tunebook.data.stream), not by skipping
        stream.load_state_dict(process["data"])
    for name, thing in (registered or {}).items():
        if name in process:
            thing.load_state_dict(process[name])
    if best is not None and state.get("best"):
        best.load_state_dict(state["best"])
    if optimizer_changes:
        _apply_optimizer_config(config, optimizer, lr_scheduler)
        log.warning("Resumed with changed optimizer settings, applied from step %d on: %s", state["global_step"],
                    ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in optimizer_changes.items()))  # fmt: skip
    return checkpoint, state


def _load_checkpoint(accelerator, checkpoint: Path, lr_scheduler) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load `checkpoint` into the prepared objects; return (the trainer state, this process's state). A file that
    does not load (damaged after verification, or in a checkpoint saved without a manifest) stops every process
    with one line, not a traceback on one of them while the others wait."""
    own_schedule = schedule_state(accelerator, lr_scheduler) is not None
    error = None
    try:
        if own_schedule:  # under DeepSpeed; first, to refuse a pickled schedule before Accelerate reads the folder
            load_schedule(checkpoint, lr_scheduler)
        accelerator.load_state(str(checkpoint))
        load_rng_state(checkpoint, accelerator.process_index)  # Accelerate swallows a failure to restore them
        loaded = load_trainer_state(checkpoint), load_process_state(checkpoint, accelerator.process_index)
    except TunebookError as raised:
        error = raised
    except Exception as raised:
        error = TrainingError(f"checkpoint {checkpoint} does not load: {type(raised).__name__}: {first_line(raised)}")
    failed = [(accelerator.process_index, type(error), str(error))] if error is not None else []
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        failed = gather_object(failed)
    if failed:
        rank, kind, message = failed[0]
        raise same_on_every_rank(kind(f"process {rank}: {message}" if accelerator.num_processes > 1 else message))
    return loaded


def load_rng_state(checkpoint: str | Path, process_index: int) -> None:
    """Restore this process's random number generators from `random_states_<rank>.pkl`, or raise.

    Accelerate's `load_state` restores them too but swallows any failure (a damaged file resumed silently with other
    random numbers, so no longer the same computation); this reads the same file the same way (`weights_only`) and
    sets the same generators again, so that a failure stops the run."""
    import random

    import numpy as np
    import torch
    from accelerate.utils import load

    path = Path(checkpoint) / f"random_states_{process_index}.pkl"
    try:
        states = load(path)
        random.setstate(states["random_state"])
        np.random.set_state(states["numpy_random_seed"])
        torch.set_rng_state(states["torch_manual_seed"])
        if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
            torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
    except Exception as error:
        raise TrainingError(
            f"{path}: the random number generators' state cannot be restored ({type(error).__name__}: "
            f"{first_line(error)}); the resumed run would not continue the same computation"
        ) from None


def schedule_state(accelerator, lr_scheduler) -> dict[str, Any] | None:
    """The learning-rate schedule's state as plain data, where Accelerate's `save_state` leaves the schedule out
    (under DeepSpeed, see `optim.build_scheduler`); None where Accelerate saves it. Its multiplier functions are code and
    stay out: they are rebuilt from the config (`build_scheduler`), only where the schedule is (its step, its rates)
    is state. Saved as JSON so that resuming unpickles nothing (Accelerate's custom objects load with
    `weights_only=False`)."""
    if lr_scheduler is None or lr_scheduler in compat.prepared_schedulers(accelerator):
        return None
    return {k: v for k, v in lr_scheduler.state_dict().items() if k != "lr_lambdas"}


def load_schedule(checkpoint: Path, lr_scheduler) -> None:
    """Restore `schedule_state`'s JSON into `lr_scheduler` (a `LambdaLR`, or Accelerate's wrapper of one)."""
    path = checkpoint / SCHEDULE
    if not path.is_file():
        if any(checkpoint.glob("custom_checkpoint_*.pkl")):
            raise ConfigError(
                f"{checkpoint} holds its learning-rate schedule as a pickle (custom_checkpoint_0.pkl, as Tunebook "
                "wrote it under DeepSpeed before lr_scheduler.json), which Tunebook no longer loads: unpickling it "
                "could run any code. Start a new run, or finish this one with the Tunebook that wrote it"
            )
        raise ConfigError(
            f"{checkpoint} holds no learning-rate schedule: it was written under DeepSpeed by a Tunebook that left "
            "the schedule out, and a resumed run would restart it. Start a new run"
        )
    schedule = getattr(lr_scheduler, "scheduler", lr_scheduler)
    try:
        state = json.loads(path.read_text())  # the schedule's own keys only: data, never its optimizer or code
        state = {k: v for k, v in state.items() if k in vars(schedule) and k not in ("optimizer", "lr_lambdas")}
        schedule.load_state_dict({**state, "lr_lambdas": [None] * len(schedule.lr_lambdas)})
    except (OSError, ValueError, TypeError, AttributeError) as error:
        raise TrainingError(f"{path}: unreadable learning-rate schedule ({first_line(error)})") from None


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
    compat.set_last_lr(schedule, [group["lr"] for group in optimizer.param_groups])
    for index, group in enumerate(optimizer.param_groups):
        group["betas"], group["eps"] = (config.adam_beta1, config.adam_beta2), config.adam_epsilon
        if index == 0:  # the decayed matrices (build_optimizer): biases and norms never decay
            group["weight_decay"] = config.weight_decay
