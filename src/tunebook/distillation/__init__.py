"""Knowledge distillation together (recipes/distill.py): the teacher (`teacher`), GKD's loss from the two output
layers a chunk at a time (`losses`), and completions the student or teacher samples (`sampling`)."""

from __future__ import annotations

from .losses import chunk_rows, distill_token_losses, generalized_jsd, token_losses
from .sampling import batch_prompts, completion_sampling, is_on_policy_step, sampled_batch
from .teacher import build_teacher, check_shared_tokenizer, teacher_dtype

__all__ = [
    "batch_prompts",
    "build_teacher",
    "check_shared_tokenizer",
    "chunk_rows",
    "completion_sampling",
    "distill_token_losses",
    "generalized_jsd",
    "is_on_policy_step",
    "sampled_batch",
    "teacher_dtype",
    "token_losses",
]
