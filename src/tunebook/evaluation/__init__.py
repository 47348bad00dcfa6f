"""Evaluation shared by recipes: token-weighted loss, generation exact match, offline `evaluate` metrics, preference
pairs (DPO and reward models)."""

from .classification import classifier_inputs, evaluate_classifier
from .generate import generation_exact_match
from .loss import evaluate_loss
from .metrics import LOCAL_METRICS, load_metric, load_metrics

__all__ = [
    "LOCAL_METRICS",
    "classifier_inputs",
    "evaluate_classifier",
    "evaluate_loss",
    "generation_exact_match",
    "load_metric",
    "load_metrics",
]
