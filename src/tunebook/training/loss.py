"""Causal-LM loss normalised by the loss-bearing tokens of the whole optimizer step.

A per-micro-batch mean weights a token in a short micro-batch more than one in a long micro-batch, so
accumulating k means is not the gradient of one batch of their union (transformers#24725, torchtune#2307).
Here every micro-batch contributes `sum of token losses / tokens in the whole step`, counted over all
micro-batches of the step and all processes, which equals one big batch exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data.tokenize import IGNORE_INDEX

__all__ = ["count_loss_tokens", "per_example_token_loss", "step_loss_scale", "token_loss_sum"]


def count_loss_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that carry loss after the causal shift (position 0 is never predicted)."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def per_example_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy and loss-token count of each example, in float32. Shapes: (batch,)."""
    shift_logits = logits[..., :-1, :].float()
    shift_labels = labels[..., 1:]
    losses = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(shift_labels.shape)
    return losses.sum(dim=-1), (shift_labels != IGNORE_INDEX).sum(dim=-1)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over all loss-bearing tokens, in float32."""
    return per_example_token_loss(logits, labels)[0].sum()


def step_loss_scale(step_tokens: torch.Tensor, num_processes: int, gradient_accumulation_steps: int) -> torch.Tensor:
    """Factor turning a micro-batch's summed loss into its share of the step's token-mean loss.

    `step_tokens` is the loss-token count of the whole optimizer step, summed over micro-batches and processes.
    DDP averages gradients over processes and `accelerator.backward` divides by the accumulation steps, so
    both are multiplied back in. Stays a tensor, so the step needs no host sync.
    """
    return num_processes * gradient_accumulation_steps / step_tokens.clamp(min=1).float()
