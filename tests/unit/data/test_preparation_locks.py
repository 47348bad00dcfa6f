"""Data preparation locks what it builds, not the cache: for every recipe, a run preparing other data in the same
cache_dir goes on while one build is under way, and two runs preparing the same data build it once.

Two threads stand for two processes: each lock is a separate flock on its own file descriptor, which excludes
threads of one process as it excludes processes. A build is held open inside its lock (in `save_to_disk`, which
every cache entry calls while its lock is held) until the other run has finished, or is seen waiting.
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import datasets
import pytest

from tunebook.data import synthetic
from tunebook.data.cache import tokenizer_fingerprint
from tunebook.distributed import prepare_then_join
from tunebook.preference.data import write_synthetic_preferences
from tunebook.recipe import RECIPES, recipe_config_class, recipe_data
from tunebook.rl.prompts import write_synthetic_prompts

LOG = logging.getLogger("test")
GUARD = 60  # seconds a held build waits for the other run before giving up (only reached when the lock is wrong)
SOLO = SimpleNamespace(num_processes=1, process_index=0)
WRITERS = {
    "sft": synthetic.write_synthetic_task,
    "classify": synthetic.write_synthetic_classification,
    "pretrain": synthetic.write_synthetic_text,
    "dpo": write_synthetic_preferences,
    "kto": write_synthetic_preferences,  # pairs, split into rows
    "reward": write_synthetic_preferences,
    "grpo": write_synthetic_prompts,
    "distill": synthetic.write_synthetic_task,  # SFT's data
}


def _config(recipe: str, cache, size: int):
    """The recipe's config with its generated data of `size` examples, written now: two threads of one process
    writing the same file at once would share its temporary name (two processes do not)."""
    WRITERS[recipe](cache / "synthetic", size, 4, 0)
    return recipe_config_class(recipe)(synthetic_train_size=size, synthetic_eval_size=4, max_seq_length=64, seed=0)


def _prepare(recipe: str, cache, size: int, results: dict, name: str) -> None:
    config = _config(recipe, cache, size)
    try:
        results[name] = prepare_then_join(SOLO, config, recipe_data(recipe), cache, LOG)
    except BaseException as error:  # re-raised by the test thread
        results[name] = error


def _hold_the_first_build(monkeypatch, until: threading.Event) -> dict:
    """Hold the first `save_to_disk` (inside a cache entry's lock) until `until` is set; returns what happened."""
    save, held = datasets.Dataset.save_to_disk, {"thread": None, "released": threading.Event(), "waited": False}
    lock = threading.Lock()

    def holding(self, *args, **kwargs):
        with lock:
            first = held["thread"] is None
            if first:
                held["thread"] = threading.current_thread().name
        if first:
            held["released"].set()
            held["waited"] = until.wait(GUARD)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", holding)
    return held


def _run(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_run_preparing_other_data_in_the_same_cache_does_not_wait_for_a_build(recipe, tmp_path, monkeypatch):
    other_done, results = threading.Event(), {}
    held = _hold_the_first_build(monkeypatch, other_done)
    first = threading.Thread(target=_prepare, args=(recipe, tmp_path, 40, results, "first"), name="first")
    first.start()
    assert held["released"].wait(GUARD)  # the first run is inside its build, holding that entry's lock

    def other():
        _prepare(recipe, tmp_path, 50, results, "other")
        other_done.set()

    _run([threading.Thread(target=other, name="other")])
    first.join()
    for name in ("first", "other"):
        if isinstance(results[name], BaseException):
            raise results[name]
    assert held["thread"] == "first"
    assert held["waited"], "the other run waited for the first run's build of different data"
    assert "train tokenisation" in results["other"].built


@pytest.mark.parametrize("recipe", RECIPES)
def test_two_runs_preparing_the_same_data_at_once_build_it_once(recipe, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="tunebook")  # where a run says it waits for another
    _config(recipe, tmp_path, 40)
    waiting = threading.Event()

    class SeesWaiting(logging.Handler):
        def emit(self, record):
            if "Waiting for another process" in record.getMessage():
                waiting.set()

    handler = SeesWaiting()
    logging.getLogger("tunebook").addHandler(handler)
    try:
        held, results = _hold_the_first_build(monkeypatch, waiting), {}
        _run([threading.Thread(target=_prepare, args=(recipe, tmp_path, 40, results, n), name=n) for n in "ab"])
    finally:
        logging.getLogger("tunebook").removeHandler(handler)
    for name in "ab":
        if isinstance(results[name], BaseException):
            raise results[name]
    assert held["waited"], "the second run never waited for the first run's build"
    built = results["a"].built + results["b"].built
    assert built and len(built) == len(set(built)), built  # each cache entry (and the tokenizer) built once
    a, b = results["a"], results["b"]
    assert a.train[:] == b.train[:]
    assert tokenizer_fingerprint(a.tokenizer) == tokenizer_fingerprint(b.tokenizer)
