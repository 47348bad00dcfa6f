"""Collators: pad a list of tokenised examples into a batch."""

from __future__ import annotations

from typing import Any

import torch

from .tokenize import IGNORE_INDEX

__all__ = ["PadCollator", "loss_positions", "padded_length"]


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
