"""The plan at the start of every run: `per_device_train_batch_size: auto` resolved, one line logged, and what
`summary.json` records beside the measured peak, so that every run checks the planner."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import fields

import torch

from ..errors import ConfigError
from .hardware import GiB, Hardware
from .layout import Layout

__all__ = ["AUTO", "measured_peak", "plan_at_start"]

AUTO = "auto"


def plan_at_start(config, recipe: str, accelerator, log: logging.Logger) -> dict | None:
    """Resolve `per_device_train_batch_size: auto` (every process the same, from the main process's plan) and log
    the run's plan; returns what `summary.json` records of it (None where it could not be made)."""
    from ..distributed import decided_by_main

    auto = config.per_device_train_batch_size == AUTO
    if not auto and not accelerator.is_main_process:
        return None
    layout, device = layout_of(accelerator), hardware_of(accelerator)
    if auto:
        with _no_partitioned_init(accelerator):
            chosen = decided_by_main(accelerator, lambda: _choose_batch(config, recipe, layout, device, log))
        config.per_device_train_batch_size, config.gradient_accumulation_steps = chosen
    if not accelerator.is_main_process:
        return None
    from .memory import plan

    try:
        with _no_partitioned_init(accelerator):
            made = plan(recipe, config, layout, device, on_gpu=accelerator.device.type == "cuda")
    except Exception as error:  # an architecture the planner cannot trace must not stop a run it would not plan
        log.warning("Memory plan not made (%s: %s); the run goes on", type(error).__name__, str(error)[:200])
        return None
    log.info("Memory plan: %.2f GiB peak per device of %.1f GiB (%s)%s", made.total / GiB, device.memory / GiB,
             ", ".join(f"{part} {getattr(made, part) / GiB:.2f}" for part in _shown(made)),
             "" if made.fits else f"; it may not fit: `tunebook plan {recipe}` says what to change")  # fmt: skip
    return {
        "planned_peak_gib": made.total / GiB,
        "planned_allocated_gib": made.allocated / GiB,
        "device_memory_gib": device.memory / GiB,
        "fits": made.fits,
    }


@contextlib.contextmanager
def _no_partitioned_init(accelerator):
    """Under DeepSpeed ZeRO-3, transformers builds every model inside `zero.Init` (while accelerate's DeepSpeed
    config is registered with it), whose partitioning is a collective: the planner's model (one process, on the
    meta device) is built with the registration lifted, then put back."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    registered = getattr(plugin, "dschf", None)  # accelerate's HfDeepSpeedConfig, which transformers holds weakly
    if registered is None:
        yield
        return
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(registered)


def measured_peak(device: torch.device) -> dict:
    """The peak the caching allocator saw, to set beside the plan's `allocated` figure."""
    if device.type == "cuda":
        return {"measured_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GiB}
    return {"measured_peak_allocated_gib": None,
            "measured_by": "not on a CPU (no allocator statistics); benchmarks/plan_accuracy.py traces CPU steps"}  # fmt: skip


def layout_of(accelerator) -> Layout:
    """The run's layout as the Accelerator has it (what `read_layout` reads from its config file)."""
    kind = str(accelerator.distributed_type).split(".")[-1]
    processes, mixed = accelerator.num_processes, str(accelerator.mixed_precision)
    if kind == "FSDP":
        plugin = accelerator.state.fsdp_plugin
        return Layout("fsdp2", processes, mixed, processes,
                      reshard_after_forward=bool(getattr(plugin, "reshard_after_forward", True)),
                      offload_params=bool(getattr(getattr(plugin, "cpu_offload", None), "offload_params", False)),
                      activation_checkpointing=bool(getattr(plugin, "activation_checkpointing", False)))  # fmt: skip
    if kind == "DEEPSPEED":
        zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        stage = 3 if int(zero.get("stage", 2)) == 3 else 2
        offload = {k: str((zero.get(k) or {}).get("device", "none")) == "cpu" for k in ("offload_param",
                                                                                       "offload_optimizer")}  # fmt: skip
        return Layout(f"zero{stage}", processes, mixed, processes, offload_params=offload["offload_param"],
                      offload_optimizer=offload["offload_optimizer"])  # fmt: skip
    return Layout("ddp" if processes > 1 else "single", processes, mixed, 1)


def hardware_of(accelerator) -> Hardware:
    """This process's device: a GPU's memory and peak FLOP/s, or on a CPU the machine's memory shared by the
    processes on it."""
    from .flops import device_peak_flops

    device = accelerator.device
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return Hardware(properties.name, float(properties.total_memory), accelerator.num_processes,
                        device_peak_flops(device))  # fmt: skip
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, accelerator.state.num_processes)
    return Hardware("CPU", float(memory), accelerator.num_processes, None)


def _choose_batch(config, recipe: str, layout: Layout, device: Hardware, log: logging.Logger) -> tuple[int, int]:
    """The largest micro-batch that fits, at most the recipe's default, with the accumulation that keeps the
    default x `gradient_accumulation_steps` samples per optimizer step (per device)."""
    import copy

    from .memory import plan
    from .recommend import smaller_micro_batches

    default = next(f.default for f in fields(config) if f.name == "per_device_train_batch_size")
    on_gpu = device.name != "CPU"
    trial = copy.copy(config)
    for batch, steps in [(default, config.gradient_accumulation_steps)] + smaller_micro_batches(
        default, config.gradient_accumulation_steps
    ):
        trial.per_device_train_batch_size, trial.gradient_accumulation_steps = batch, steps
        made = plan(recipe, trial, layout, device, on_gpu=on_gpu)
        if made.fits:
            log.info("per_device_train_batch_size auto: %d (gradient_accumulation_steps %d), planned peak %.2f GiB of "
                     "%.1f GiB", batch, steps, made.total / GiB, device.memory / GiB)  # fmt: skip
            return batch, steps
    raise ConfigError(f"per_device_train_batch_size auto: not even 1 fits in {device.memory / GiB:.1f} GiB "
                      f"(planned {made.total / GiB:.1f} GiB); `tunebook plan {recipe} ...` says what to change")  # fmt: skip


def _shown(made) -> list[str]:
    from .memory import PARTS

    return [part for part in PARTS if getattr(made, part)]
