"""Collators: a list of tokenised examples into a batch, for each kind of batch the recipes and evaluations use:
padded examples (`PadCollator`), packed rows (`PackedCollator`), preference pairs (`PairCollator`) and left-padded
prompts for generation (`PromptCollator`)."""

from __future__ import annotations

from typing import Any

import torch

from ..models.attention import BLOCK_MASK_PREFIX, document_kv_blocks
from .tokenize import IGNORE_INDEX

__all__ = [
    "PackedCollator",
    "PadCollator",
    "PairCollator",
    "PromptCollator",
    "left_padded",
    "loss_positions",
    "padded_length",
]


def padded_length(features: list[dict[str, Any]], pad_to_multiple_of: int | None) -> int:
    """The longest `input_ids` of a batch, rounded up to a multiple (tensor cores like multiples of 8)."""
    longest = max(len(f["input_ids"]) for f in features)
    if pad_to_multiple_of:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    return longest


def loss_positions(labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Where the loss is: `loss_positions`, flat indices into (batch x length) of the positions whose next token
    carries a label, and `loss_targets`, those labels.

    The collators add both to every batch, so the output layer can run only where the loss needs it
    (`tunebook.training.causal_lm_token_losses`) and the device never waits on the `nonzero` that finds them.
    """
    shifted = labels[:, 1:]
    rows, cols = torch.nonzero(shifted != IGNORE_INDEX, as_tuple=True)
    return {"loss_positions": rows * labels.shape[1] + cols, "loss_targets": shifted[rows, cols]}


class PadCollator:
    """Right-pad `input_ids`/`labels` to the longest example in the batch (rounded up to a multiple).

    Padding positions get attention_mask 0 and label IGNORE_INDEX, so they change neither the loss nor,
    through the causal mask, any real token's output. A class rather than a closure so DataLoader workers
    can pickle it.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = padded_length(features, self.pad_to_multiple_of)
        input_ids = torch.full((len(features), longest), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), longest), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(features), longest), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            input_ids[i, :n] = torch.as_tensor(f["input_ids"])
            labels[i, :n] = torch.as_tensor(f["labels"])
            attention_mask[i, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, **loss_positions(labels)}


class PackedCollator:
    """Batch packed rows: pad to the longest row (rounded up to a multiple), or to `row_length` when given, and
    restart positions per example.

    Returns `input_ids`, `labels`, `position_ids` and `seq_ids` (the example index of every token within its row;
    the padding tail is a segment of its own, so no row of an attention mask is ever empty). `attention_inputs`
    turns these into what the model's attention backend needs. Given `attn_implementation="flex_attention"`, it
    also adds the tiles of FlexAttention's block mask (`document_kv_blocks`), so they are computed in the loader's
    worker and reach the device with the batch's other tensors.

    `row_length` and `rows` (max_seq_length and the micro-batch size, under torch_compile) give every batch of a run
    one shape, so compiled blocks keep one static graph and never recompile: packed rows are nearly full, so padding
    them to `row_length` adds a few tokens a batch, and the last, smaller batch of an epoch gets rows of padding
    alone, which carry no label, count as no token or sample, and so change neither the loss nor its gradient.
    """

    def __init__(
        self,
        pad_token_id: int,
        pad_to_multiple_of: int | None = None,
        attn_implementation: str | None = None,
        row_length: int | None = None,
        rows: int | None = None,
    ):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.block_mask = attn_implementation == "flex_attention"
        self.row_length, self.rows = row_length, rows

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.rows is not None and len(features) < self.rows:
            features = features + [{"input_ids": [], "labels": [], "seq_lengths": []}] * (self.rows - len(features))
        longest = padded_length(features, None if self.row_length else self.pad_to_multiple_of)
        if self.row_length:
            if longest > self.row_length:
                raise ValueError(f"a packed row of {longest} tokens is longer than row_length {self.row_length}")
            longest = self.row_length
        shape = (len(features), longest)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        seq_ids = torch.zeros(shape, dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            input_ids[i, :n] = torch.as_tensor(f["input_ids"])
            labels[i, :n] = torch.as_tensor(f["labels"])
            lengths = list(f["seq_lengths"]) + ([longest - n] if longest > n else [])
            position_ids[i] = torch.cat([torch.arange(m) for m in lengths])
            seq_ids[i] = torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(lengths))
        # attention_mask marks real tokens for the token counters; the model gets attention_inputs() instead.
        attention_mask = (
            torch.arange(longest)[None, :] < torch.tensor([len(f["input_ids"]) for f in features])[:, None]
        )
        batch = {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": position_ids,
            "seq_ids": seq_ids,
            "attention_mask": attention_mask.long(),
            **loss_positions(labels),
        }
        if self.block_mask:
            batch.update({BLOCK_MASK_PREFIX + k: v for k, v in document_kv_blocks(seq_ids).items()})
        return batch


class PairCollator:
    """A batch of B pairs as one padded batch of 2B sequences, the chosen first: one forward pass scores both
    (and under DDP one all-reduce covers both). Precomputed reference log-probabilities and a reward model's
    margins come along as tensors, one value per pair."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad = PadCollator(pad_token_id, pad_to_multiple_of)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences = [
            {"input_ids": f[f"{side}_input_ids"], "labels": f[f"{side}_labels"]}
            for side in ("chosen", "rejected")
            for f in features
        ]
        batch = self.pad(sequences)
        for key in ("ref_chosen_logps", "ref_rejected_logps", "margin"):
            if key in features[0]:
                batch[key] = torch.tensor([f[key] for f in features], dtype=torch.float32)
        return batch


def left_padded(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of token rows padded on the left, so that generation continues every row at the
    same position."""
    longest = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, longest - len(row) :] = torch.as_tensor(row, dtype=torch.long)
        attention_mask[i, longest - len(row) :] = 1
    return input_ids, attention_mask


class PromptCollator:
    """Left-pad the prompts (everything before the last assistant turn) and keep the reference answers' ids."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        input_ids, attention_mask = left_padded([f["input_ids"][: f["prompt_length"]] for f in features],
                                                self.pad_token_id)  # fmt: skip
        references = [
            [
                t
                for t, label in zip(f["input_ids"][f["prompt_length"] :], f["labels"][f["prompt_length"] :])
                if label != IGNORE_INDEX
            ]
            for f in features
        ]
        width = max(len(r) for r in references)
        ref_ids = torch.full((len(references), max(width, 1)), -1, dtype=torch.long)
        for i, r in enumerate(references):
            ref_ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "reference_ids": ref_ids}
