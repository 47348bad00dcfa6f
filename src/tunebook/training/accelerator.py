"""Create the one `Accelerator` a recipe uses, and refuse launches that would silently train alone."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedType, InitProcessGroupKwargs, str_to_bool

from ..errors import ConfigError
from ..models.lora import register_adapter_checkpoints
from ..models.wrappers import look_for_deepspeed_only_once_imported
from ..run.trackers import resolve_report_to, trackers_dir
from ..run.upload import check_hub_access

__all__ = ["build_accelerator", "check_deepspeed", "check_engine", "has_accelerator_device", "recipe_accelerator"]


def has_accelerator_device() -> bool:
    return torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()


def build_accelerator(
    gradient_accumulation_steps: int,
    non_blocking: bool = True,
    report_to: str | list[str] = "none",
    output_dir: str | None = None,
    ddp_timeout: int = 1800,
    max_grad_norm: float = 1.0,
    **kwargs,
) -> Accelerator:
    """An Accelerator configured by `accelerate launch` / its config file, plus what recipes always need.

    - `ddp_timeout` for the process group's collectives (the start-up check has its own, shorter one).
    - The trackers of `report_to` (see `tunebook.run.trackers`), writing local files under `output_dir/runs`.
    - `cpu=True` when the machine has no accelerator: with accelerate 1.15 a multi-process launch on a CPU-only
      machine otherwise starts processes that each train alone instead of forming a gloo group.
    - A seedable sampler so the data order depends only on the seed (and can be resumed exactly).
    - `non_blocking` host-to-device copies: with pinned memory the copy of the next batch overlaps compute.
    - The scheduler is stepped once per optimizer step by the recipe (`step_scheduler_with_optimizer=False`):
      Accelerate's default steps it `num_processes` times per step, which only works if the schedule was built
      for `num_processes` times more steps.
    """
    deepspeed = str_to_bool(os.environ.get("ACCELERATE_USE_DEEPSPEED", "false"))
    # Under DeepSpeed the engine clips inside its step, with Accelerate's "auto" value fixed at 1.0: hand it ours.
    if deepspeed:
        os.environ.setdefault("ACCELERATE_GRADIENT_CLIPPING", str(max_grad_norm))
    # DeepSpeed runs on a CPU too (its CPU accelerator): `cpu=True` would make Accelerate drop it, and without a
    # backend named Accelerate finds none on a CPU and leaves every process of a launch to train alone.
    cpu_only = not has_accelerator_device()
    cpu_deepspeed = {"backend": "gloo"} if deepspeed and cpu_only else {}
    if cpu_only:
        # Wherever DeepSpeed gets imported (a DeepSpeed launch, a library that checks for it), its device detection
        # warns that it "was unable to detect" a GPU. Naming its CPU accelerator, the one it would pick here, keeps
        # that line out of the run's log.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    look_for_deepspeed_only_once_imported()
    log_with = resolve_report_to(report_to)
    if log_with and output_dir is None:
        raise ValueError("build_accelerator: trackers need output_dir")
    accelerator = Accelerator(
        cpu=cpu_only and not deepspeed,
        log_with=log_with or None,
        project_dir=trackers_dir(output_dir) if log_with else None,
        gradient_accumulation_steps=gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=non_blocking),
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=ddp_timeout), **cpu_deepspeed)],
        **kwargs,
    )
    check_engine(accelerator)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise ConfigError(
            f"the launcher started {launched} processes but Accelerate formed a group of "
            f"{accelerator.num_processes}: each process would train alone. On CPU use "
            "accelerate_configs/multi_cpu.yaml; on GPUs check the accelerate config"
        )
    return accelerator


def check_engine(accelerator: Accelerator) -> None:
    """Stop if the accelerate config asked for FSDP or DeepSpeed and Accelerate is not running it.

    Accelerate silently drops its FSDP plugin without CUDA, and DeepSpeed in a process not started by its launcher
    (plain DDP, or one process, trains instead), so a run would look fine while sharding, its memory savings and its
    checkpoint format are absent. DeepSpeed itself also runs on a CPU (its CPU accelerator, over gloo).
    """
    wanted = {
        "FSDP": (
            str_to_bool(os.environ.get("ACCELERATE_USE_FSDP", "false")), DistributedType.FSDP,
            "FSDP needs CUDA GPUs here. Use accelerate_configs/cpu.yaml or multi_cpu.yaml on a CPU",
        ),
        "DeepSpeed": (
            str_to_bool(os.environ.get("ACCELERATE_USE_DEEPSPEED", "false")), DistributedType.DEEPSPEED,
            "DeepSpeed starts only in processes launched by `tunebook train` or `accelerate launch`",
        ),
    }  # fmt: skip
    for engine, (requested, distributed_type, hint) in wanted.items():
        if requested and accelerator.distributed_type != distributed_type:
            raise ConfigError(
                f"the accelerate config asks for {engine} but Accelerate started {accelerator.distributed_type.value} "
                f"on {accelerator.device.type} ({accelerator.num_processes} process(es)): {hint}"
            )


def recipe_accelerator(config) -> Accelerator:
    """`build_accelerator` with a recipe config's settings (any `TrainConfig`), checked against the engine."""
    check_hub_access(config)  # push_to_hub without network or token stops here, not after training
    accelerator = build_accelerator(
        config.gradient_accumulation_steps,
        non_blocking=config.dataloader_non_blocking,
        report_to=config.report_to,
        output_dir=config.output_dir,
        ddp_timeout=config.ddp_timeout,
        max_grad_norm=config.max_grad_norm,
    )
    register_adapter_checkpoints(accelerator, config.output_dir)  # a LoRA model's checkpoints hold only its adapters
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        check_deepspeed(accelerator, config)
    return accelerator


def check_deepspeed(accelerator: Accelerator, config) -> None:
    """Stop at start-up on DeepSpeed settings that would fail or mislead only later in the run."""
    if config.nan_policy == "skip":
        raise ConfigError(
            "nan_policy: skip does not work under DeepSpeed, whose engine applies the update inside backward; "
            "use nan_policy: stop"
        )
    zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
    if zero.get("stage") == 3 and not zero.get("stage3_gather_16bit_weights_on_model_save"):
        # Else Accelerate refuses to gather the weights for the final model directory after the whole run.
        raise ConfigError(
            "the accelerate config runs DeepSpeed ZeRO-3 without zero3_save_16bit_model: true (the DeepSpeed "
            "config's stage3_gather_16bit_weights_on_model_save): the trained model could not be saved as a Hugging "
            "Face directory. Set it, as accelerate_configs/deepspeed_zero3.yaml does"
        )
