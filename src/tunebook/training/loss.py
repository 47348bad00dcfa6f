"""Causal-LM loss normalised by the loss-bearing tokens of the whole optimizer step.

A per-micro-batch mean weights a token in a short micro-batch more than one in a long micro-batch, so
accumulating k means is not the gradient of one batch of their union (transformers#24725, torchtune#2307).
Here every micro-batch contributes `sum of token losses / tokens in the whole step`, counted over all
micro-batches of the step and all processes, which equals one big batch exactly.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from ..data.collate import loss_positions
from ..data.tokenize import IGNORE_INDEX
from ..models.linear_ce import linear_losses
from ..models.wrappers import unwrap

__all__ = [
    "causal_lm_token_losses",
    "fusable_output_layer",
    "count_loss_tokens",
    "output_layer_at",
    "per_example_token_loss",
    "step_loss_scale",
    "token_loss_sum",
]

logger = logging.getLogger("tunebook")


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
def output_layer_at(
    model: torch.nn.Module,
    positions: torch.Tensor,
    targets: torch.Tensor | None = None,
    temperature: float = 1.0,
    mode=None,
):
    """Inside this block, `model`'s output layer (the LM head) runs only on the hidden states at `positions`
    (flat indices into batch x length), so its logits have shape (len(positions), vocab).

    transformers models apply the LM head to every position; in SFT the prompt tokens (a third of Code Alpaca's)
    and the padding carry no loss, yet their logits cost a vocabulary-wide matmul, softmax and backward each. The
    hook sits on the head inside the (DDP/FSDP-wrapped) model, so distributed wrappers see an ordinary forward,
    and the head's weight is the gathered one.

    With `targets`, the layer returns each position's float32 cross-entropy against its target instead of logits
    (`linear_ce.linear_cross_entropy`, chunked: the logits never exist whole), and the block yields the
    `linear_losses` that computed them (its `result` stays None if the layer never applied `F.linear` to them), of
    the logits divided by `temperature`. `mode`, another `linear_ce.HeadCall`, takes its place (distillation's
    heads).
    """
    head = unwrap(model).get_output_embeddings()
    if head is None:
        yield None
        return
    fused = mode if mode is not None else linear_losses(targets, temperature) if targets is not None else None

    def select(module, args):
        hidden = args[0]
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        if fused is not None:
            fused.start(hidden)
        return (hidden, *args[1:])

    handles = [head.register_forward_pre_hook(select)]
    if fused is not None:
        handles.append(head.register_forward_hook(lambda *_: fused.stop()))
    try:
        yield fused
    finally:
        for handle in handles:
            handle.remove()
        if fused is not None:
            fused.stop()  # if the layer raised before its forward hook


def causal_lm_token_losses(
    model: torch.nn.Module, inputs: dict[str, Any], batch: dict[str, torch.Tensor], temperature: float = 1.0
):
    """Next-token cross-entropy (float32) of every loss-bearing token of `batch`, computing logits only there; of
    the logits divided by `temperature` (GRPO's log-probs of the tempered distribution it sampled from).

    `inputs` are the model's keyword arguments (`attention_inputs`); `batch` has `labels` and, from the
    collators, `loss_positions`/`loss_targets` (computed here if absent). Returns (losses, positions); the row of
    each loss is `positions // batch["labels"].shape[1]`. Equals `per_example_token_loss` on full logits.

    Where the output layer is a plain linear layer (`nn.Linear`, also inside peft's `modules_to_save` or
    `trainable_token_indices` wrappers, tied to the embeddings or not), the loss is fused into it: the
    (positions, vocab) logits and their gradient are never materialised, only chunks of them
    (`linear_ce.CHUNK_ELEMENTS` logits each); logits that fit in one chunk keep their softmax for the backward
    instead (no recompute). A head that is not a plain linear layer (LoRA on `lm_head`, a quantized layer),
    or a model that changes its logits after the head (Gemma-2's `final_logit_softcapping`, Cohere's
    `logit_scale`, Granite's `logits_scaling`), gets the logits at the loss positions and `F.cross_entropy` on
    them instead. So does a model found doing so at run time, or failing on the fused losses, once a warning says so
    (that batch runs twice).
    """
    if "loss_positions" not in batch:
        batch = {**batch, **loss_positions(batch["labels"])}
    positions, targets = batch["loss_positions"], batch["loss_targets"]
    fused = None
    try:
        fusable = fusable_output_layer(model, len(positions))
        with output_layer_at(model, positions, targets if fusable else None, temperature) as fused:
            logits = model(**inputs).logits
    except (IndexError, RuntimeError, ValueError):
        if fused is None or fused.result is None:  # the head never returned losses: not the fusion's doing
            raise
        # The model works on its logits after the head (xLSTM reads their length in evaluation) and broke on losses.
        return _unfused(model, inputs, batch, "fails on fused losses from its output layer", temperature)
    if fused is not None and fused.result is not None:
        # The head's losses came out untouched, or only cast by a wrapper (FSDP2's output_dtype).
        if logits is fused.result or (logits.shape == fused.result.shape and logits.dtype != fused.result.dtype):
            return logits.float(), positions
        return _unfused(model, inputs, batch, "changes its logits after the output layer", temperature)
    if logits.dim() == 3:  # the model made its logits without calling its output layer module: pick them here
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, positions)
    logits = logits.float() if temperature == 1.0 else logits.float() / temperature
    return F.cross_entropy(logits, targets, reduction="none"), positions


def _unfused(model: torch.nn.Module, inputs: dict[str, Any], batch: dict[str, torch.Tensor], why: str,
             temperature: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The batch again with logits from the output layer, and the model type remembered for the next batches."""
    _CHANGES_LOGITS.add(_model_type(model))
    logger.warning("%s %s: its loss is computed from logits (not fused)", type(unwrap(model)).__name__, why)
    return causal_lm_token_losses(model, inputs, batch, temperature)


# Config keys of models that scale, soft-cap or slice the logits after the head (transformers 5.x; swept over its
# causal LMs, comparing the fused loss with full logits: Falcon-H1's `lm_head_multiplier` is always set, xLSTM's
# `output_logit_soft_cap` defaults to 30).
_LOGIT_CHANGES = (
    "final_logit_softcapping",
    "logits_soft_cap",
    "logit_scale",
    "logits_scaling",
    "output_multiplier",
    "unpadded_vocab_size",
    "lm_head_multiplier",
    "output_logit_soft_cap",
)
_CHANGES_LOGITS: set[str] = set()  # model types seen doing so at run time


def fusable_output_layer(model: torch.nn.Module, positions: int) -> bool:
    """Some position carries a loss, the output layer computes its logits with plain `F.linear`, and the model
    returns them unchanged (as far as known)."""
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    configs = [config, getattr(config, "text_config", None)]
    if any(getattr(c, key, None) is not None for c in configs for key in _LOGIT_CHANGES):
        return False
    if _model_type(model) in _CHANGES_LOGITS:
        return False
    head = inner.get_output_embeddings()
    if type(head).__name__ in ("ModulesToSaveWrapper", "TrainableTokensWrapper"):  # peft's, around the layer
        head = head.original_module
    # Exactly nn.Linear's forward (FSDP2 subclasses the class, bitsandbytes' Linear4bit overrides forward).
    plain = isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward
    return plain and positions > 0


def _model_type(model: torch.nn.Module) -> str:
    return getattr(getattr(unwrap(model), "config", None), "model_type", "") or ""


def step_loss_scale(step_tokens: torch.Tensor, num_processes: int, gradient_accumulation_steps: int) -> torch.Tensor:
    """Factor turning a micro-batch's summed loss into its share of the step's token-mean loss.

    `step_tokens` is the loss-token count of the whole optimizer step, summed over micro-batches and processes.
    DDP averages gradients over processes and `accelerator.backward` divides by the accumulation steps, so
    both are multiplied back in. Stays a tensor, so the step needs no host sync.
    """
    return num_processes * gradient_accumulation_steps / step_tokens.clamp(min=1).float()
