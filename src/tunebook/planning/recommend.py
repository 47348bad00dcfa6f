"""What to change when a plan does not fit: the first change, in the order a practitioner tries them, that fits,
as ready `--key value` overrides (and accelerate options).

1. a smaller micro-batch with more gradient accumulation, the same samples per optimizer step (the same training);
2. gradient checkpointing (a third more compute);
3. LoRA instead of full fine-tuning (what trains changes: said so);
4. FSDP2 sharding across the GPUs given (`accelerate_configs/fsdp.yaml`, with its activation checkpointing);
5. ZeRO-3 with the optimizer and weights offloaded to CPU memory (much slower steps);
6. 4-bit QLoRA.

Within a change, the largest micro-batch that fits: the fastest. (The loss's logits need no change: where the
head allows, the recipes' loss is computed a chunk of logits at a time already, `models/linear_ce.py`.)
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from .layout import Layout

__all__ = ["recommend", "smaller_micro_batches"]


def smaller_micro_batches(batch: int, accumulation: int) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs below `batch` with the same samples per step, largest micro-batch first."""
    total = batch * accumulation
    return [(b, total // b) for b in range(batch - 1, 0, -1) if total % b == 0 and (total // b) % accumulation == 0]


def recommend(config, layout: Layout, gpus: int, planner: Callable) -> tuple[list[str], object | None]:
    """The overrides of the first change that fits and its plan, or ([], None) when nothing on the list fits.
    `planner(config, layout)` plans a changed config."""
    steps: list[tuple[list[str], Callable, Layout | None]] = [([], lambda c: c, None)]
    steps.append((["--gradient_checkpointing true"], _set(gradient_checkpointing=True), None))
    if not config.use_peft:
        steps.append((["--use_peft true"], _set(use_peft=True, gradient_checkpointing=True), None))
    if gpus > 1 and not layout.sharded:
        fsdp = Layout("fsdp2", gpus, _mixed(layout), gpus, activation_checkpointing=True)
        steps.append((["--config_file accelerate_configs/fsdp.yaml", f"--num_processes {gpus}"], _set(), fsdp))
    offload = Layout("zero3", gpus, _mixed(layout), gpus, offload_params=True, offload_optimizer=True)
    steps.append(
        (
            [
                "--config_file accelerate_configs/deepspeed_zero3.yaml",
                f"--num_processes {gpus}",
                "--offload_optimizer_device cpu",
                "--offload_param_device cpu",
            ],
            _set(gradient_checkpointing=True),
            offload,
        )  # fmt: skip
    )
    if not config.load_in_4bit and config.model_name_or_path:
        steps.append((["--use_peft true", "--load_in_4bit true"],
                      _set(use_peft=True, load_in_4bit=True, gradient_checkpointing=True), None))  # fmt: skip
    batch, accumulation = config.per_device_train_batch_size, config.gradient_accumulation_steps
    for overrides, change, new_layout in steps:
        changed = change(config)
        target = new_layout or layout
        sizes = [(batch, accumulation)] if overrides else []
        sizes += smaller_micro_batches(batch, accumulation)
        smallest = _with_batch(changed, *sizes[-1]) if sizes else changed
        if not sizes or not planner(smallest, target).fits:
            continue
        for size, steps_ in sizes:  # the largest micro-batch that fits
            result = planner(_with_batch(changed, size, steps_), target)
            if result.fits:
                extra = [] if size == batch else [f"--per_device_train_batch_size {size}",
                                                  f"--gradient_accumulation_steps {steps_}"]  # fmt: skip
                return overrides + extra, result
    return [], None


def _set(**values):
    def change(config):
        config = copy.copy(config)
        for key, value in values.items():
            setattr(config, key, value)
        return config

    return change


def _with_batch(config, batch: int, accumulation: int):
    config = copy.copy(config)
    config.per_device_train_batch_size, config.gradient_accumulation_steps = batch, accumulation
    return config


def _mixed(layout: Layout) -> str:
    return layout.mixed_precision if layout.mixed_precision != "no" else "bf16"
