"""What a resume restores by itself: the learning-rate schedule as JSON where Accelerate leaves it out (DeepSpeed),
never a pickle; the random number generators, with a failure that stops instead of passing silently."""

from __future__ import annotations

import json
import pickle
import random
from types import SimpleNamespace

import pytest
import torch

from tunebook.errors import ConfigError, TrainingError
from tunebook.training.optim import build_scheduler
from tunebook.training.resumption import load_rng_state, load_schedule, schedule_state


def _schedule():
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    return optimizer, build_scheduler("cosine", optimizer, 10, 0.2)


def test_the_schedule_is_saved_as_json_and_continues_where_it_was(tmp_path):
    optimizer, schedule = _schedule()
    for _ in range(3):
        optimizer.step()
        schedule.step()
    deepspeed = SimpleNamespace(_schedulers=[])  # Accelerate under DeepSpeed: the schedule is not among its own
    state = schedule_state(deepspeed, schedule)
    (tmp_path / "lr_scheduler.json").write_text(json.dumps(state))
    assert schedule_state(SimpleNamespace(_schedulers=[schedule]), schedule) is None  # Accelerate saves it itself

    resumed_optimizer, resumed = _schedule()
    load_schedule(tmp_path, resumed)
    assert resumed.last_epoch == 3 and resumed.get_last_lr() == schedule.get_last_lr()
    for _ in range(5):  # the multipliers come from the config; where the schedule is comes from the checkpoint
        optimizer.step(), resumed_optimizer.step()
        schedule.step(), resumed.step()
        assert resumed.get_last_lr() == schedule.get_last_lr()


class _RunsCode:
    def __reduce__(self):
        return (open, (str(_RunsCode.marker), "w"))


def test_a_pickled_schedule_is_refused_unread(tmp_path):
    """A DeepSpeed checkpoint of an earlier Tunebook held its schedule as a pickle, which Accelerate loads with
    `weights_only=False`: anything in it would run. It is refused, never unpickled."""
    _RunsCode.marker = tmp_path / "ran"
    (tmp_path / "custom_checkpoint_0.pkl").write_bytes(pickle.dumps({"last_epoch": 3, "x": _RunsCode()}))
    with pytest.raises(ConfigError, match=r"holds its learning-rate schedule as a pickle .* unpickling it could run"):
        load_schedule(tmp_path, _schedule()[1])
    assert not _RunsCode.marker.exists()
    (tmp_path / "custom_checkpoint_0.pkl").unlink()
    with pytest.raises(ConfigError, match="holds no learning-rate schedule: it was written under DeepSpeed"):
        load_schedule(tmp_path, _schedule()[1])


def test_the_schedules_json_sets_only_the_schedules_own_keys(tmp_path):
    (tmp_path / "lr_scheduler.json").write_text(json.dumps({"last_epoch": 4, "optimizer": "x", "other": 1}))
    optimizer, schedule = _schedule()
    load_schedule(tmp_path, schedule)
    assert schedule.last_epoch == 4 and schedule.optimizer is optimizer and not hasattr(schedule, "other")
    (tmp_path / "lr_scheduler.json").write_text("{garbage")
    with pytest.raises(TrainingError, match="lr_scheduler.json: unreadable learning-rate schedule"):
        load_schedule(tmp_path, schedule)


def test_random_states_are_restored_or_the_resume_stops(tmp_path):
    import numpy as np

    states = {"random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
              "torch_manual_seed": torch.get_rng_state()}  # fmt: skip
    torch.save(states, tmp_path / "random_states_0.pkl")  # as Accelerate's save_state writes them
    expected = random.random(), float(np.random.rand()), float(torch.rand(1))
    load_rng_state(tmp_path, 0)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
    path = tmp_path / "random_states_0.pkl"
    path.write_bytes(b"garbage")  # Accelerate's load_state logs "Could not load random states" at INFO and goes on
    cannot = r"random_states_0.pkl: the random number generators' state cannot be restored \(UnpicklingError: "
    with pytest.raises(TrainingError, match=cannot + r".*\); the resumed run would not continue"):
        load_rng_state(tmp_path, 0)
    with pytest.raises(TrainingError, match=r"random_states_1.pkl: .*FileNotFoundError"):
        load_rng_state(tmp_path, 1)
