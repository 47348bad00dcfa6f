"""Create the one `Accelerator` a recipe uses, and refuse launches that would silently train alone."""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from ..errors import ConfigError

__all__ = ["build_accelerator", "has_accelerator_device"]


def has_accelerator_device() -> bool:
    return torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()


def build_accelerator(gradient_accumulation_steps: int, non_blocking: bool = True, **kwargs) -> Accelerator:
    """An Accelerator configured by `accelerate launch` / its config file, plus what recipes always need.

    - `cpu=True` when the machine has no accelerator: with accelerate 1.15 a multi-process launch on a CPU-only
      machine otherwise starts processes that each train alone instead of forming a gloo group.
    - A seedable sampler so the data order depends only on the seed (and can be resumed exactly).
    - `non_blocking` host-to-device copies: with pinned memory the copy of the next batch overlaps compute.
    - The scheduler is stepped once per optimizer step by the recipe (`step_scheduler_with_optimizer=False`):
      Accelerate's default steps it `num_processes` times per step, which only works if the schedule was built
      for `num_processes` times more steps.
    """
    accelerator = Accelerator(
        cpu=not has_accelerator_device(),
        gradient_accumulation_steps=gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=non_blocking),
        step_scheduler_with_optimizer=False,
        **kwargs,
    )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise ConfigError(
            f"the launcher started {launched} processes but Accelerate formed a group of "
            f"{accelerator.num_processes}: each process would train alone. On CPU use "
            "accelerate_configs/multi_cpu.yaml; on GPUs check the accelerate config"
        )
    return accelerator
