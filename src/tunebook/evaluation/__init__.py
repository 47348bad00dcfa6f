"""Evaluation helpers shared by recipes: token-weighted loss and generation-based exact match."""

from .generate import PromptCollator, generation_exact_match
from .loss import evaluate_loss

__all__ = ["PromptCollator", "evaluate_loss", "generation_exact_match"]
