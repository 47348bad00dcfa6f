"""BestModel: what counts as an improvement, patience, and its state across a resume."""

from __future__ import annotations

import json

import pytest

from tunebook.errors import ConfigError
from tunebook.training import BestModel, infer_greater_is_better


def test_best_model_update_and_patience():
    tracker = BestModel("eval_accuracy", greater_is_better=True, patience=2)
    assert tracker.update(1, {"eval_accuracy": 0.5})
    assert not tracker.update(2, {"eval_accuracy": 0.5})  # equal is not better
    assert tracker.update(3, {"eval_accuracy": 0.7}) and tracker.evals_without_improvement == 0
    assert not tracker.update(4, {"eval_accuracy": float("nan")})
    assert not tracker.should_stop()
    assert not tracker.update(5, {"eval_accuracy": 0.6}) and tracker.should_stop()
    again = BestModel("eval_accuracy", True, 2)
    again.load_state_dict(json.loads(json.dumps(tracker.state_dict())))
    assert (again.best_value, again.best_step, again.evals_without_improvement) == (0.7, 3, 2)
    with pytest.raises(ConfigError, match="eval_f1.*not among the evaluation results.*eval_accuracy"):
        BestModel("eval_f1", True).update(1, {"eval_accuracy": 1.0})


def test_direction_is_inferred_from_the_metric_name():
    assert not infer_greater_is_better("eval_loss") and not infer_greater_is_better("eval_perplexity")
    assert infer_greater_is_better("eval_accuracy") and infer_greater_is_better("eval_f1")


def test_when_to_evaluate_and_save():
    from types import SimpleNamespace

    from tunebook.training import eval_due, save_due

    steps = SimpleNamespace(eval_strategy="steps", eval_steps=5, save_strategy="steps", save_steps=0,
                            load_best_model_at_end=True)  # fmt: skip
    assert [s for s in range(1, 21) if eval_due(steps, s, 20, epoch_done=False)] == [5, 10, 15]  # 20: the final one
    epochs = SimpleNamespace(eval_strategy="epoch", eval_steps=5, save_strategy="epoch", save_steps=0,
                             load_best_model_at_end=False)  # fmt: skip
    assert eval_due(epochs, 7, 20, epoch_done=True) and not eval_due(epochs, 5, 20, epoch_done=False)
    assert save_due(epochs, 7, epoch_done=True, new_best=False) == "end of an epoch"
    assert save_due(epochs, 8, epoch_done=False, new_best=True) is None  # best checkpoints only when loading one
    assert save_due(steps, 8, epoch_done=False, new_best=True) == "best evaluation so far"
