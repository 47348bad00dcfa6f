"""Evaluation shared by recipes: token-weighted loss, generation exact match, offline `evaluate` metrics."""

from .generate import PromptCollator, generation_exact_match
from .loss import evaluate_loss
from .metrics import LOCAL_METRICS, load_metric, load_metrics

__all__ = ["LOCAL_METRICS", "PromptCollator", "evaluate_loss", "generation_exact_match", "load_metric", "load_metrics"]
