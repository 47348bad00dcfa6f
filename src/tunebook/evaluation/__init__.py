"""Evaluation shared by recipes: token-weighted loss, generation exact match, offline `evaluate` metrics, preference
pairs (DPO and reward models). Every evaluation runs on one scaffold (`batches.gathered_batches`); every generation
stops by one rule (`stop_token_ids`) and is compared with its reference by one rule (`scores.exact_matches`)."""

from .batches import gathered_batches
from .classification import classifier_inputs, evaluate_classifier
from .generate import generation_exact_match, log_samples, stop_token_ids
from .loss import evaluate_loss
from .metrics import LOCAL_METRICS, load_metric, load_metrics

__all__ = [
    "LOCAL_METRICS",
    "classifier_inputs",
    "evaluate_classifier",
    "evaluate_loss",
    "gathered_batches",
    "generation_exact_match",
    "load_metric",
    "load_metrics",
    "log_samples",
    "stop_token_ids",
]
