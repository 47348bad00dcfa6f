"""The `eval_harness_*` keys: on every recipe that trains a causal LM (every config with `eval_harness_tasks`,
today's and the next one's), a task that is not one or a missing lm-eval is one line when the config loads."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from tunebook.config import load_config
from tunebook.errors import ConfigError
from tunebook.recipe import RECIPES, recipe_config_class

WITH_HARNESS = [
    n for n in RECIPES if "eval_harness_tasks" in {f.name for f in dataclasses.fields(recipe_config_class(n))}
]


def test_every_causal_lm_recipe_has_the_keys():
    assert {"sft", "pretrain", "dpo", "grpo"} <= set(WITH_HARNESS)


@pytest.mark.parametrize("name", WITH_HARNESS)
def test_a_task_that_is_not_one_stops_the_config(name, tmp_path, monkeypatch):
    config_class = recipe_config_class(name)
    missing = str(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"^eval_harness_tasks: .*missing\.yaml: no such task YAML file$"):
        load_config(config_class, ["--eval_harness_tasks", f"[{missing}]"])
    with pytest.raises(ConfigError, match=r"^eval_harness_at_eval runs the harness tasks at each evaluation"):
        load_config(config_class, ["--eval_harness_at_eval", "true"])
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "lm_eval" else find_spec(m, *a))
    with pytest.raises(ConfigError, match=r'not installed here: pip install "tunebook\[eval\]"$'):
        load_config(config_class, ["--eval_harness_tasks", f"[{missing}]"])
    # A plan of such a run reads no task files and needs no lm-eval (its files are checked where it runs).
    assert load_config(config_class, ["--eval_harness_tasks", f"[{missing}]"], check_files=False)
