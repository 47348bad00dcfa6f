"""`report_to` resolution and what the trackers receive."""

from __future__ import annotations

import pytest

from tunebook.config import TrainConfig, parse_config
from tunebook.errors import ConfigError
from tunebook.run.trackers import resolve_report_to, tracker_values


def test_report_to_names_lists_auto_and_none():
    assert resolve_report_to("auto") == ["tensorboard"]  # installed with the dev extras
    assert resolve_report_to("none") == [] and resolve_report_to([]) == []
    assert resolve_report_to(["tensorboard", "TensorBoard"]) == ["tensorboard"]
    assert resolve_report_to(" tensorboard , ") == ["tensorboard"]
    assert parse_config(TrainConfig, overrides={"report_to": "[tensorboard]"}).report_to == ["tensorboard"]


def test_unknown_missing_or_contradictory_trackers_are_config_errors():
    with pytest.raises(ConfigError, match="unknown tracker 'tensorbord'"):
        parse_config(TrainConfig, overrides={"report_to": "tensorbord"})
    with pytest.raises(ConfigError, match="cannot be combined"):
        resolve_report_to("none,tensorboard")
    from accelerate.tracking import get_available_trackers

    missing = [t for t in ("wandb", "mlflow", "trackio") if t not in {str(a) for a in get_available_trackers()}]
    if missing:
        with pytest.raises(ConfigError, match=f"report_to asks for {missing[0]} but it is not installed: pip install"):
            resolve_report_to(missing[0])


def test_tracker_values_group_train_and_eval_scalars():
    record = {"step": 4, "epoch": 0.5, "loss": 1.5, "learning_rate": 1e-4, "train_tokens": 900}
    assert tracker_values(record) == {
        "train/epoch": 0.5,
        "train/loss": 1.5,
        "train/learning_rate": 1e-4,
        "train/train_tokens": 900,
    }
    evaluation = {"step": 4, "eval_loss": 0.7, "eval_accuracy": 0.9, "eval_sample": "text", "eval_best": None}
    assert tracker_values(evaluation) == {"eval/loss": 0.7, "eval/accuracy": 0.9}


def test_samples_go_to_tensorboard_as_text_and_to_wandb_as_a_table():
    from types import SimpleNamespace

    from tunebook.run.trackers import log_samples, samples_markdown

    calls = []
    trackers = [
        SimpleNamespace(name="tensorboard", log=lambda values, step: calls.append(("text", values, step))),
        SimpleNamespace(name="wandb", log_table=lambda name, columns, data, step: calls.append((name, columns, data))),
        SimpleNamespace(name="mlflow", log=lambda values, step: calls.append(("numbers only", values))),
    ]
    samples = [{"prompt": "Sort | these\n312", "completion": "123"}, {"prompt": "hi", "completion": ""}]
    log_samples(SimpleNamespace(trackers=trackers), samples, step=7)
    table = "| prompt | completion |\n| --- | --- |\n| Sort \\| these ⏎ 312 | 123 |\n| hi | *(empty)* |"
    assert samples_markdown(samples) == table
    assert calls == [
        ("text", {"samples": table}, 7),
        ("samples", ["step", "prompt", "completion"], [[7, "Sort | these\n312", "123"], [7, "hi", ""]]),
    ]
