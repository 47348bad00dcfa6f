"""AdamW with decay only on matrices, and warmup schedules."""

from __future__ import annotations

import math

import torch
from transformers import get_scheduler

__all__ = ["build_optimizer", "build_scheduler"]


def build_optimizer(
    model: torch.nn.Module, learning_rate: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> torch.optim.AdamW:
    """AdamW; biases and norm weights (1-D parameters) get no weight decay, as is standard for transformers.

    The fused implementation (one kernel over all parameters) where torch has it for every parameter's dtype: on a
    CPU torch's default is a Python loop over the parameters, which took 1.1 s per step against 17 ms fused for
    31 tensors of a 4-layer 256-wide model (foreach: 100 ms); on CUDA fused is the fastest too. The update is the
    same AdamW up to float rounding.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_floating_point() for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=eps, fused=fused or None)


def build_scheduler(name: str, optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float):
    """A schedule over `total_steps` optimizer steps with `ceil(warmup_ratio * total_steps)` warmup steps.

    Recipes prepare it on its own, after the model: `accelerator.prepare(build_scheduler(...))`. Under DeepSpeed,
    Accelerate (1.15) hands back a scheduler prepared apart from its model unwrapped and unregistered, so
    `save_state` leaves it out: checkpoints then hold its state as JSON (`resumption.schedule_state`), not as a
    custom object, which Accelerate would unpickle with `weights_only=False` on resume."""
    warmup = math.ceil(warmup_ratio * total_steps)
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=max(total_steps, 1))
