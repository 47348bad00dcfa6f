"""Tunebook's offline `evaluate` modules: loaded by name with no network, against hand counts."""

from __future__ import annotations

import math

import pytest

from tunebook.errors import ConfigError
from tunebook.evaluation import LOCAL_METRICS, load_metric, load_metrics

# 3 classes; per class (tp, predicted, support): 0: (2, 3, 3), 1: (1, 2, 2), 2: (1, 2, 2)
PREDICTIONS = [0, 0, 1, 2, 2, 0, 1]
REFERENCES = [0, 0, 1, 2, 1, 2, 0]


def test_local_metrics_are_all_there():
    assert {"accuracy", "f1", "precision", "recall", "exact_match", "perplexity"} <= set(LOCAL_METRICS)


def test_accuracy_and_macro_scores_match_hand_counts():
    combined = load_metrics(["accuracy", "f1", "precision", "recall"], average="macro")
    for start in range(0, len(PREDICTIONS), 3):  # accumulated batch by batch, as the eval loop does
        combined.add_batch(predictions=PREDICTIONS[start : start + 3], references=REFERENCES[start : start + 3])
    got = combined.compute()
    precision = [2 / 3, 1 / 2, 1 / 2]
    recall = [2 / 3, 1 / 2, 1 / 2]
    f1 = [2 * p * r / (p + r) for p, r in zip(precision, recall)]
    assert got["accuracy"] == pytest.approx(4 / 7)
    assert got["precision"] == pytest.approx(sum(precision) / 3)
    assert got["recall"] == pytest.approx(sum(recall) / 3)
    assert got["f1"] == pytest.approx(sum(f1) / 3)


def test_binary_scores_use_the_positive_class():
    predictions, references = [1, 1, 0, 0, 1], [1, 0, 0, 1, 1]  # tp 2, fp 1, fn 1
    assert load_metric("precision").compute(predictions=predictions, references=references)["precision"] == 2 / 3
    assert load_metric("recall", "binary").compute(predictions=predictions, references=references)["recall"] == 2 / 3
    f1 = load_metric("f1").compute(predictions=predictions, references=references)["f1"]
    assert f1 == pytest.approx(2 / 3)
    # No positive predictions at all: precision is 0, not a division error.
    assert load_metric("precision").compute(predictions=[0, 0], references=[1, 0])["precision"] == 0.0
    with pytest.raises(ValueError, match="binary"):
        load_metric("f1").compute(predictions=[0, 1, 2], references=[0, 1, 2])


def test_exact_match_and_perplexity():
    em = load_metric("exact_match")
    assert em.compute(predictions=[" 42", "abc", "X"], references=["42 ", "abd", "x"])["exact_match"] == 1 / 3
    assert em.compute(predictions=["X"], references=["x"], ignore_case=True)["exact_match"] == 1.0
    got = load_metric("perplexity").compute(predictions=[6.0, 3.0], references=[4, 2])
    assert got["loss"] == pytest.approx(1.5)
    assert got["perplexity"] == pytest.approx(math.exp(1.5))


def test_unknown_metric_is_a_clear_error():
    with pytest.raises(ConfigError, match="metric 'acuracy' not found.*accuracy, exact_match, f1"):
        load_metric("acuracy")
    with pytest.raises(ConfigError, match="twice"):
        load_metrics(["accuracy", "accuracy"])
