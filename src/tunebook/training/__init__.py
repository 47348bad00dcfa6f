"""The pieces of the training loop, called by name from recipes (the loop itself stays in the recipes)."""

from .accelerator import build_accelerator, has_accelerator_device
from .loss import count_loss_tokens, per_example_token_loss, step_loss_scale, token_loss_sum
from .optim import build_optimizer, build_scheduler
from .steps import accumulation_windows, total_optimizer_steps

__all__ = [
    "accumulation_windows",
    "build_accelerator",
    "build_optimizer",
    "build_scheduler",
    "count_loss_tokens",
    "has_accelerator_device",
    "per_example_token_loss",
    "step_loss_scale",
    "token_loss_sum",
    "total_optimizer_steps",
]
