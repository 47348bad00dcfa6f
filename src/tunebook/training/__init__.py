"""The training loop: its bookkeeping (`loop`) and the step's guard (`step`), written once, and the pieces recipes
call by name."""

from ..planning.flops import model_flops_per_token
from .accelerator import build_accelerator, has_accelerator_device, recipe_accelerator
from .best import BestModel, infer_greater_is_better
from .compilation import compile_model
from .counters import LossWindow, TrainCounters
from .guard import StopSignals, exit_code, is_nonfinite, nonfinite_stop
from .loop import (
    Checkpointed,
    Plan,
    Run,
    RunState,
    Training,
    after_step,
    epochs,
    finish,
    load_checkpoint_or_start,
    plan_steps,
    start_run,
    start_training,
)
from .loss import (
    causal_lm_token_losses,
    count_loss_tokens,
    output_layer_at,
    per_example_token_loss,
    step_loss_scale,
    token_loss_sum,
)
from .optim import build_optimizer, build_scheduler
from .step import finite_on_every_process, optimizer_step_or_skip
from .steps import accumulation_windows, eval_due, micro_batch, save_due, total_optimizer_steps
from .throughput import Throughput, peak_memory
from .warmup import sft_warmup

__all__ = [
    "Checkpointed",
    "LossWindow",
    "Plan",
    "Run",
    "RunState",
    "Training",
    "after_step",
    "compile_model",
    "epochs",
    "finish",
    "finite_on_every_process",
    "load_checkpoint_or_start",
    "optimizer_step_or_skip",
    "plan_steps",
    "start_run",
    "start_training",
    "recipe_accelerator",
    "Throughput",
    "peak_memory",
    "sft_warmup",
    "model_flops_per_token",
    "BestModel",
    "infer_greater_is_better",
    "nonfinite_stop",
    "StopSignals",
    "TrainCounters",
    "accumulation_windows",
    "micro_batch",
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
    "eval_due",
    "save_due",
]
