"""The loop's own decisions on a fake run (no launch, no model): when to evaluate and save (`eval_due`, `save_due`),
and the order `after_step` keeps: count the step, log, evaluate, best model, stop signal, save, early stop."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from tunebook.training import Plan, RunState, after_step, eval_due, save_due
from tunebook.training import loop as loop_module


def _config(**changes):
    base = {"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 0,
            "load_best_model_at_end": False, "logging_steps": 1}  # fmt: skip
    return SimpleNamespace(**{**base, **changes})


@pytest.mark.parametrize(
    ("changes", "due"),
    [
        ({}, [2, 4]),  # 6 is the last step: the final evaluation is finish's
        ({"eval_steps": 0}, []),
        ({"eval_strategy": "epoch"}, [3]),  # epochs end after steps 3 and 6
        ({"eval_strategy": "no", "eval_steps": 0}, []),
    ],
)
def test_eval_due(changes, due):
    config = _config(**changes)
    assert [s for s in range(1, 7) if eval_due(config, s, 6, epoch_done=s % 3 == 0)] == due


@pytest.mark.parametrize(
    ("changes", "step", "epoch_done", "new_best", "reason"),
    [
        ({"save_steps": 2}, 4, False, False, "every 2 steps"),
        ({"save_steps": 2}, 3, False, False, None),
        ({"save_strategy": "epoch"}, 3, True, False, "end of an epoch"),
        ({"save_strategy": "epoch"}, 4, False, False, None),
        ({"save_strategy": "no"}, 4, True, True, None),
        ({"save_strategy": "no", "load_best_model_at_end": True}, 5, False, True, "best evaluation so far"),
        ({"save_steps": 2, "load_best_model_at_end": True}, 4, False, True, "every 2 steps"),  # the first reason
    ],
)
def test_save_due(changes, step, epoch_done, new_best, reason):
    assert save_due(_config(**changes), step, epoch_done, new_best) == reason


class _Events(list):
    """What the fake run's parts were asked to do, in order."""


def _fake(events: _Events, config, step: int = 1, signal: int | None = None, best_improves: bool = False,
          stop_early: bool = False):  # fmt: skip
    """A Run and a Training of fakes, at `step` - 1 steps done, that note each call into `events`."""
    best = SimpleNamespace(update=lambda step, results: events.append("best") or best_improves,
                           should_stop=lambda: stop_early, metric="eval_loss", best_value=1.0, best_step=1,
                           patience=1)  # fmt: skip
    saved = SimpleNamespace(state=RunState(global_step=step - 1), best=best,
                            figures=SimpleNamespace(pop=lambda accelerator: events.append("log") or {"loss": 0.5}))  # fmt: skip
    run = SimpleNamespace(
        config=config,
        accelerator=None,
        log=logging.getLogger("tunebook"),
        output_dir=Path("unused"),
        stop=None,
        timer=SimpleNamespace(step_done=lambda: events.append("count"), paused=contextlib.nullcontext),
        signals=SimpleNamespace(requested=lambda accelerator: events.append("signal") or signal),
    )
    loop = SimpleNamespace(
        plan=Plan(total_steps=6, steps_per_epoch=3, micro_batches=6), saved=saved, state=saved.state, compiled=None,
        heartbeat=None,  # the main process's timed lines: tests/unit/training/test_throughput.py
        progress=SimpleNamespace(update=lambda n: None), train_loader=[0, 1, 2],
        throughput=SimpleNamespace(window=lambda: {}), metrics=SimpleNamespace(write=lambda record: None),
        evaluation=lambda: events.append("evaluate") or {"eval_loss": 1.0}, samples=None,
    )  # fmt: skip
    return run, loop


@pytest.fixture
def saves(monkeypatch):
    """`after_step`'s saves, noted instead of written (and no progress bar)."""
    import tunebook.run.logging

    events = _Events()
    monkeypatch.setattr(tunebook.run.logging, "show_progress", lambda *args: None)
    monkeypatch.setattr(loop_module, "_save", lambda run, loop, reason: events.append(f"save: {reason}") or True)
    return events


def test_after_step_logs_evaluates_notes_the_best_then_saves(saves):
    run, loop = _fake(saves, _config(save_steps=2), step=2, best_improves=True)
    assert not after_step(run, loop, window=[0], grad_norm=1.0, learning_rate=0.1)
    assert saves == ["count", "log", "evaluate", "best", "signal", "save: every 2 steps"]
    assert loop.state.global_step == 2 and loop.state.batches_in_epoch == 1 and 2 in loop.state.eval_history


def test_a_stop_signal_saves_after_the_steps_evaluation_and_ends_the_run(saves):
    run, loop = _fake(saves, _config(save_steps=2), step=2, signal=15)
    assert after_step(run, loop, window=[0], grad_norm=1.0, learning_rate=0.1)
    assert saves == ["count", "log", "evaluate", "best", "signal", "save: stopped by signal 15"]  # saved once
    assert isinstance(run.stop, SystemExit) and run.stop.code == 143


def test_early_stopping_comes_after_the_save(saves):
    run, loop = _fake(saves, _config(save_steps=2), step=2, stop_early=True)
    assert after_step(run, loop, window=[0], grad_norm=1.0, learning_rate=0.1)
    assert saves[-1] == "save: every 2 steps" and run.stop is None


def test_a_stopped_step_is_neither_counted_nor_logged(saves):
    run, loop = _fake(saves, _config(save_steps=1), step=3)
    run.stop = RuntimeError("non-finite")
    assert after_step(run, loop, window=[0], grad_norm=1.0, learning_rate=0.1)
    assert saves == [] and loop.state.global_step == 2


def test_a_step_that_trained_on_its_window_again_leaves_the_data_where_it_was(saves):
    """GRPO's updates before the last of one generation batch: the step counts, the data position does not move."""
    run, loop = _fake(saves, _config(eval_steps=0), step=1)
    after_step(run, loop, window=[0, 1], grad_norm=1.0, learning_rate=0.1, data_advanced=False)
    assert loop.state.global_step == 1 and loop.state.batches_in_epoch == 0
    after_step(run, loop, window=[0, 1], grad_norm=1.0, learning_rate=0.1)
    assert loop.state.global_step == 2 and loop.state.batches_in_epoch == 2


def test_the_last_step_ends_the_loop(saves):
    run, loop = _fake(saves, _config(), step=6)
    assert after_step(run, loop, window=[0], grad_norm=1.0, learning_rate=0.1)
    assert "evaluate" not in saves  # the last step's evaluation is finish's


def test_sample_replies_go_to_the_log_and_the_record_not_into_the_evaluation(saves, caplog):
    run, loop = _fake(saves, _config(eval_steps=2), step=2)
    written = []
    loop.metrics = SimpleNamespace(write=written.append)
    loop.samples = lambda: saves.append("samples") or [{"prompt": "12345", "completion": "54321"}]
    with caplog.at_level(logging.INFO, logger="tunebook"):
        after_step(run, loop, window=[0], grad_norm=1.0, learning_rate=0.1)
    assert saves[saves.index("evaluate") + 1] == "samples"  # with the evaluation, the model in the same state
    assert written[-1] == {"step": 2, "eval_loss": 1.0, "samples": [{"prompt": "12345", "completion": "54321"}]}
    assert loop.state.eval_history[2] == {"eval_loss": 1.0}  # the best model and checkpoints never see them
    assert "  sample '12345' -> '54321'" in caplog.text
