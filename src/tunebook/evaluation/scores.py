"""The arithmetic behind Tunebook's offline `evaluate` metric modules (see `metric_modules/`).

Plain numpy on label ids, so the metrics need neither the Hub nor scikit-learn; the tests check them against
hand counts. `average` follows scikit-learn: `binary` scores the `pos_label` class, `macro` is the unweighted mean
over classes, `micro` pools all decisions, `weighted` weights each class by its support.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["AVERAGES", "accuracy", "exact_match", "exact_matches", "perplexity", "precision_recall_f1"]

AVERAGES = ("binary", "macro", "micro", "weighted")


def accuracy(predictions: Sequence[int], references: Sequence[int]) -> float:
    predictions, references = np.asarray(predictions), np.asarray(references)
    return float((predictions == references).mean()) if len(references) else 0.0


def precision_recall_f1(
    predictions: Sequence[int], references: Sequence[int], average: str = "binary", pos_label: int = 1
) -> dict[str, float]:
    """Precision, recall and F1; a class with no predictions (or no references) scores 0 there, as in sklearn."""
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {', '.join(AVERAGES)}, got {average!r}")
    predictions, references = np.asarray(predictions, dtype=np.int64), np.asarray(references, dtype=np.int64)
    labels = np.union1d(predictions, references)
    if average == "binary":
        if len(labels) > 2:
            raise ValueError(f"average='binary' needs at most 2 classes, got labels {labels.tolist()}; use 'macro'")
        labels = np.array([pos_label])
    tp = np.array([np.sum((predictions == c) & (references == c)) for c in labels], dtype=np.float64)
    predicted = np.array([np.sum(predictions == c) for c in labels], dtype=np.float64)
    support = np.array([np.sum(references == c) for c in labels], dtype=np.float64)
    if average == "micro":
        tp, predicted, support = tp.sum(keepdims=True), predicted.sum(keepdims=True), support.sum(keepdims=True)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, support, out=np.zeros_like(tp), where=support > 0)
    both = precision + recall
    f1 = np.divide(2 * precision * recall, both, out=np.zeros_like(tp), where=both > 0)
    weights = support / support.sum() if average == "weighted" and support.sum() > 0 else None
    return {
        "precision": float(np.average(precision, weights=weights)),
        "recall": float(np.average(recall, weights=weights)),
        "f1": float(np.average(f1, weights=weights)),
    }


def exact_matches(predictions: Sequence[str], references: Sequence[str], ignore_case: bool = False) -> list[float]:
    """Per prediction, 1.0 where it equals its reference after stripping surrounding whitespace (and case, with
    `ignore_case`), else 0.0: the one exact-match rule, behind the `exact_match` metric, SFT's and GRPO's
    `eval_exact_match` and GRPO's `exact_match` reward."""

    def norm(s: str) -> str:
        s = s.strip()
        return s.lower() if ignore_case else s

    return [float(norm(p) == norm(r)) for p, r in zip(predictions, references, strict=True)]


def exact_match(predictions: Sequence[str], references: Sequence[str], ignore_case: bool = False) -> float:
    """Share of predictions equal to their reference (`exact_matches`); 0.0 for none."""
    hits = exact_matches(predictions, references, ignore_case)
    return sum(hits) / len(hits) if hits else 0.0


def perplexity(loss_sums: Sequence[float], token_counts: Sequence[int]) -> dict[str, float]:
    """Token-weighted mean loss and its exponential, from per-example summed losses and token counts."""
    total, tokens = float(np.sum(loss_sums, dtype=np.float64)), float(np.sum(token_counts, dtype=np.float64))
    loss = total / tokens if tokens else 0.0
    return {"loss": loss, "perplexity": float(np.exp(min(loss, 50.0)))}
