"""Evaluation shared by recipes: token-weighted loss, generation exact match, offline `evaluate` metrics, preference
pairs (DPO and reward models), replies to prompts (`tunebook chat`, `sample_prompts`). Every evaluation runs on one scaffold (`batches.gathered_batches`); every generation
stops by one rule (`stop_token_ids`) and is compared with its reference by one rule (`scores.exact_matches`)."""

from .batches import gathered_batches
from .classification import classifier_inputs, evaluate_classifier
from .generate import generation_exact_match, log_samples, stop_token_ids
from .loss import evaluate_loss
from .metrics import LOCAL_METRICS, load_metric, load_metrics
from .samples import generate_reply, prompt_ids, prompt_sampler, sample_generations

__all__ = [
    "LOCAL_METRICS",
    "classifier_inputs",
    "evaluate_classifier",
    "evaluate_loss",
    "gathered_batches",
    "generate_reply",
    "generation_exact_match",
    "load_metric",
    "load_metrics",
    "log_samples",
    "prompt_ids",
    "prompt_sampler",
    "sample_generations",
    "stop_token_ids",
]
