"""The distillation loss: TRL's generalized Jensen-Shannon divergence (GKD) between the student's and the teacher's
next-token distributions at the completion's tokens, computed from the two output layers a chunk of rows at a time.

    beta 0:  KL(teacher || student)                                   forward KL
    beta 1:  KL(student || teacher)                                   reverse KL
    else:    beta KL(teacher || M) + (1 - beta) KL(student || M),     M = (1 - beta) student + beta teacher

each of softmax(logits / temperature), summed over the vocabulary per token (Agarwal et al., "On-Policy
Distillation of Language Models", eq. 1; TRL's `GKDTrainer.generalized_jsd_loss`); `alpha` mixes in the student's
plain cross-entropy of the token, `(1 - alpha) x divergence + alpha x cross-entropy`. A recipe sums these per-token
losses and normalises by the loss tokens of the whole step (`step_loss_scale`), as SFT does: TRL's "batchmean" over a
step's tokens, exact across micro-batches and processes.

Neither model's (positions, vocab) logits exist at once. The teacher's forward (no gradients) stops at its output
layer's input: `linear_ce.HeadCall` keeps the hidden states at the loss positions and the layer's weight, and hands the model a
(positions, 0) placeholder instead of logits. The student's output layer, where it runs (its weight gathered under
FSDP/ZeRO-3), computes the losses `chunk_rows` rows at a time from both models' hidden states and weights, and
returns them in place of its logits, as the fused cross-entropy does (`tunebook.models.linear_ce`: the same chunk
size, the same hook on the layer, `output_layer_at`). Each chunk runs under activation checkpointing: its logits
are recomputed in the backward, which then holds one chunk's logits and their gradient at a time. A batch that fits
in one chunk keeps that chunk's graph instead (no recompute), as the fused cross-entropy keeps its softmax.

A head that is not a plain linear layer, or a model that changes its logits after it (`fusable_output_layer`), gets
the logits at the loss positions instead (still only there, but all at once).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..data.collate import loss_positions
from ..models import linear_ce
from ..models.build import is_partitioned
from ..training.loss import fusable_output_layer, output_layer_at

__all__ = ["chunk_rows", "distill_token_losses", "generalized_jsd", "token_losses"]


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:  # fmt: skip
    """The divergence of each row (token) of (rows, vocab) logits, in float32 (see the module's docstring)."""
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    if beta == 1:
        return (student.exp() * (student - teacher)).sum(-1)
    # log M, pairwise (logaddexp) rather than TRL's logsumexp of a stacked copy: the same value, one chunk less
    mixture = torch.logaddexp(student + math.log(1 - beta), teacher + math.log(beta))
    return beta * (teacher.exp() * (teacher - mixture)).sum(-1) + (1 - beta) * (student.exp() * (student - mixture)).sum(-1)  # fmt: skip


def token_losses(student_logits, teacher_logits, targets, beta: float, temperature: float, alpha: float):
    """Each token's loss: the divergence, mixed with the student's cross-entropy of `targets` when `alpha` > 0."""
    losses = generalized_jsd(student_logits, teacher_logits, beta, temperature)
    if alpha > 0:
        cross_entropy = F.cross_entropy(student_logits.float(), targets, reduction="none")
        losses = (1 - alpha) * losses + alpha * cross_entropy
    return losses


def chunk_rows(vocab: int) -> int:
    """Rows per chunk: `linear_ce.CHUNK_ELEMENTS` logits of each model (read at each call: tests make it small)."""
    return max(1, linear_ce.CHUNK_ELEMENTS // vocab)


def _chunk_losses(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, targets, *, beta, temperature,
                  alpha):  # fmt: skip
    with torch.no_grad():
        teacher_logits = F.linear(teacher_hidden, teacher_weight, teacher_bias)
    return token_losses(F.linear(hidden, weight, bias), teacher_logits, targets, beta, temperature, alpha)


def _teacher_head_inputs(teacher, inputs: dict, positions: torch.Tensor):
    """The teacher's hidden states at `positions` and its output layer's (weight, bias), from a forward without
    gradients that computes no logits. Under ZeRO-3 the layer's weight is whole only during its forward: copied."""
    keep = is_partitioned(teacher)

    def capture(hidden, weight, bias):
        if keep:
            weight, bias = weight.detach().clone(), None if bias is None else bias.detach().clone()
        captured.extend((hidden, weight, bias))
        return hidden.new_empty(hidden.shape[0], 0)  # a placeholder for the logits the model returns

    captured = []
    with torch.no_grad(), output_layer_at(teacher, positions, mode=linear_ce.HeadCall(capture)):
        teacher(**inputs)
    return captured if captured else None


def distill_token_losses(model, teacher, inputs: dict, teacher_inputs: dict, batch: dict, *, beta: float,
                         temperature: float, alpha: float = 0.0):  # fmt: skip
    """Each loss-bearing token's loss (`token_losses`, float32) of `batch` (`labels`, and from the collators
    `loss_positions`/`loss_targets`), with gradients to `model` only; returns (losses, positions) as
    `causal_lm_token_losses` does. `inputs`/`teacher_inputs` are each model's keyword arguments (`attention_inputs`:
    the two may differ in attention implementation and dtype)."""
    if "loss_positions" not in batch:
        batch = {**batch, **loss_positions(batch["labels"])}
    positions, targets = batch["loss_positions"], batch["loss_targets"]
    loss = partial(_chunk_losses, beta=beta, temperature=temperature, alpha=alpha)
    captured = None
    if fusable_output_layer(model, len(positions)) and fusable_output_layer(teacher, len(positions)):
        captured = _teacher_head_inputs(teacher, teacher_inputs, positions)
    if captured is not None:
        teacher_hidden, teacher_weight, teacher_bias = captured

        def fused(hidden, weight, bias):
            # One tokenizer, output layers of other sizes (Qwen2.5's 0.5B pads its vocabulary to 151,936 rows, its 7B
            # to 152,064): the rows past the tokenizer's are never a target, and the divergence is over the shared ones.
            vocab = min(weight.shape[0], teacher_weight.shape[0])
            weight, bias = weight[:vocab], None if bias is None else bias[:vocab]
            t_weight, t_bias = teacher_weight[:vocab], None if teacher_bias is None else teacher_bias[:vocab]
            rows = chunk_rows(vocab)
            if hidden.shape[0] <= rows:  # one chunk: its graph is kept, nothing recomputed
                return loss(hidden, weight, bias, teacher_hidden, t_weight, t_bias, targets)
            return torch.cat([
                checkpoint(loss, hidden[i : i + rows], weight, bias, teacher_hidden[i : i + rows], t_weight, t_bias,
                           targets[i : i + rows], use_reentrant=False)
                for i in range(0, hidden.shape[0], rows)
            ])  # fmt: skip

        head = linear_ce.HeadCall(fused)
        with output_layer_at(model, positions, mode=head):
            out = model(**inputs).logits
        if head.result is not None and out.shape == head.result.shape:  # returned untouched (or only cast)
            return out.float(), positions
    # Logits at the loss positions, both models at once: a head that is not a plain linear layer, or a model that
    # changes its logits after it (or builds them without calling its output layer).
    with torch.no_grad():
        teacher_logits = _logits_at(teacher, teacher_inputs, positions)
    student_logits = _logits_at(model, inputs, positions)
    vocab = min(student_logits.shape[-1], teacher_logits.shape[-1])
    student_logits, teacher_logits = student_logits[:, :vocab], teacher_logits[:, :vocab]
    return token_losses(student_logits, teacher_logits, targets, beta, temperature, alpha), positions


def _logits_at(model, inputs: dict, positions: torch.Tensor) -> torch.Tensor:
    with output_layer_at(model, positions):
        logits = model(**inputs).logits
    return logits.reshape(-1, logits.shape[-1]).index_select(0, positions) if logits.dim() == 3 else logits
