"""The best evaluation so far: which checkpoint to keep and export, and when to stop early."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError

__all__ = ["BestModel", "infer_greater_is_better"]


def infer_greater_is_better(metric: str) -> bool:
    """Losses and perplexities improve downwards; accuracies, F1 and the like upwards."""
    return not any(word in metric for word in ("loss", "perplexity", "error"))


@dataclass
class BestModel:
    """Tracks `metric` over evaluations: the best value, its step and checkpoint, and the evaluations since then.

    `update` after every evaluation during training; `should_stop` is true after `patience` evaluations in a row
    without improvement (patience 0: never). The state goes into every checkpoint, so a resumed run keeps its best
    and its patience count.
    """

    metric: str
    greater_is_better: bool
    patience: int = 0
    best_value: float | None = None
    best_step: int | None = None
    best_checkpoint: str | None = None
    evals_without_improvement: int = 0

    @classmethod
    def from_config(cls, config) -> BestModel | None:
        """From `metric_for_best_model`, `greater_is_better`, `early_stopping_patience`, `load_best_model_at_end`;
        None when none of them asks for tracking. The metric defaults to `eval_loss`."""
        if not (config.metric_for_best_model or config.load_best_model_at_end or config.early_stopping_patience):
            return None
        metric = config.metric_for_best_model or "eval_loss"
        if not metric.startswith("eval_"):
            metric = f"eval_{metric}"
        greater = config.greater_is_better
        return cls(
            metric, infer_greater_is_better(metric) if greater is None else greater, config.early_stopping_patience
        )

    def update(self, step: int, metrics: dict[str, Any]) -> bool:
        """Record an evaluation at `step`; True if it is a new best (a NaN never is)."""
        if self.metric not in metrics:
            raise ConfigError(
                f"metric_for_best_model: {self.metric!r} is not among the evaluation results "
                f"({', '.join(sorted(k for k in metrics if k.startswith('eval_')))})"
            )
        value = float(metrics[self.metric])
        better = not math.isnan(value) and (
            self.best_value is None or (value > self.best_value if self.greater_is_better else value < self.best_value)
        )
        if better:
            self.best_value, self.best_step, self.best_checkpoint = value, step, None
            self.evals_without_improvement = 0
        else:
            self.evals_without_improvement += 1
        return better

    def should_stop(self) -> bool:
        return self.patience > 0 and self.evals_without_improvement >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("best_value", "best_step", "best_checkpoint", "evals_without_improvement"):
            setattr(self, key, state.get(key))
        self.evals_without_improvement = self.evals_without_improvement or 0
