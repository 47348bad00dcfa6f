"""Causal-LM loss normalised by the loss-bearing tokens of the whole optimizer step.

A per-micro-batch mean weights a token in a short micro-batch more than one in a long micro-batch, so
accumulating k means is not the gradient of one batch of their union (transformers#24725, torchtune#2307).
Here every micro-batch contributes `sum of token losses / tokens in the whole step`, counted over all
micro-batches of the step and all processes, which equals one big batch exactly.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel

from ..data.collate import loss_positions
from ..data.tokenize import IGNORE_INDEX

__all__ = [
    "causal_lm_token_losses",
    "count_loss_tokens",
    "output_layer_at",
    "per_example_token_loss",
    "step_loss_scale",
    "token_loss_sum",
]


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


@contextmanager
def output_layer_at(model: torch.nn.Module, positions: torch.Tensor):
    """Inside this block, `model`'s output layer (the LM head) runs only on the hidden states at `positions`
    (flat indices into batch x length), so its logits have shape (len(positions), vocab).

    transformers models apply the LM head to every position; in SFT the prompt tokens (a third of Code Alpaca's)
    and the padding carry no loss, yet their logits cost a vocabulary-wide matmul, softmax and backward each. The
    hook sits on the head inside the (DDP/FSDP-wrapped) model, so distributed wrappers see an ordinary forward.
    """
    head = extract_model_from_parallel(model).get_output_embeddings()
    if head is None:
        yield
        return

    def select(module, args):
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions), *args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


def causal_lm_token_losses(model: torch.nn.Module, inputs: dict[str, Any], batch: dict[str, torch.Tensor]):
    """Next-token cross-entropy (float32) of every loss-bearing token of `batch`, computing logits only there.

    `inputs` are the model's keyword arguments (`attention_inputs`); `batch` has `labels` and, from the
    collators, `loss_positions`/`loss_targets` (computed here if absent). Returns (losses, positions); the row of
    each loss is `positions // batch["labels"].shape[1]`. Equals `per_example_token_loss` on full logits.
    """
    if "loss_positions" not in batch:
        batch = {**batch, **loss_positions(batch["labels"])}
    positions, targets = batch["loss_positions"], batch["loss_targets"]
    with output_layer_at(model, positions):
        logits = model(**inputs).logits
    if logits.dim() == 3:  # the model made its logits without calling its output layer module: pick them here
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, positions)
    return F.cross_entropy(logits.float(), targets, reduction="none"), positions


def step_loss_scale(step_tokens: torch.Tensor, num_processes: int, gradient_accumulation_steps: int) -> torch.Tensor:
    """Factor turning a micro-batch's summed loss into its share of the step's token-mean loss.

    `step_tokens` is the loss-token count of the whole optimizer step, summed over micro-batches and processes.
    DDP averages gradients over processes and `accelerator.backward` divides by the accumulation steps, so
    both are multiplied back in. Stays a tensor, so the step needs no host sync.
    """
    return num_processes * gradient_accumulation_steps / step_tokens.clamp(min=1).float()
