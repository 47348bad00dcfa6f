"""The pieces of the training loop, called by name from recipes (the loop itself stays in the recipes)."""

from .accelerator import build_accelerator, has_accelerator_device
from .guard import StopSignals, TrainCounters, exit_code, is_nonfinite
from .loss import (
    causal_lm_token_losses,
    count_loss_tokens,
    output_layer_at,
    per_example_token_loss,
    step_loss_scale,
    token_loss_sum,
)
from .optim import build_optimizer, build_scheduler
from .steps import accumulation_windows, total_optimizer_steps

__all__ = [
    "StopSignals",
    "TrainCounters",
    "accumulation_windows",
    "exit_code",
    "is_nonfinite",
    "build_accelerator",
    "build_optimizer",
    "build_scheduler",
    "causal_lm_token_losses",
    "count_loss_tokens",
    "has_accelerator_device",
    "output_layer_at",
    "per_example_token_loss",
    "step_loss_scale",
    "token_loss_sum",
    "total_optimizer_steps",
]
