"""`load_recipe`: a recipe's config class and main from Python, with no side effects on import."""

from __future__ import annotations

import sys

import pytest
from support import ROOT

from tunebook import ConfigError, load_recipe
from tunebook.config import (
    ClassifyConfig,
    DistillConfig,
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    PretrainConfig,
    RewardConfig,
    SFTConfig,
)
from tunebook.recipe import RECIPES, recipe_config_class


def test_each_recipe_loads_with_its_config_class(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["jupyter", "--not-a-recipe-flag"])  # importing must not parse argv
    classes = {
        "sft": SFTConfig,
        "classify": ClassifyConfig,
        "pretrain": PretrainConfig,
        "dpo": DPOConfig,
        "kto": KTOConfig,
        "reward": RewardConfig,
        "grpo": GRPOConfig,
        "distill": DistillConfig,
    }
    assert set(RECIPES) == set(classes)
    for name, cls in classes.items():
        recipe = load_recipe(name)
        assert recipe.config_class is cls is recipe_config_class(name) and recipe.name == name
        assert recipe.module.__name__ == f"tunebook.recipes.{name}"
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing trained


def test_config_overrides_are_checked_like_the_command_line():
    sft = load_recipe("sft")
    config = sft.config(max_steps=3, learning_rate="1e-4", packing=True)
    assert config.max_steps == 3 and config.learning_rate == 1e-4 and config.packing is True
    from_file = sft.config(ROOT / "recipes/configs/sft/default.yaml", seed=7)
    assert from_file.seed == 7 and from_file.model_config
    with pytest.raises(ConfigError, match="unknown config key 'lerning_rate'"):
        sft.config(lerning_rate=1e-4)
    with pytest.raises(ConfigError, match="takes a SFTConfig, got ClassifyConfig"):
        sft.main(load_recipe("classify").config())


def test_a_recipe_file_path_and_unknown_names():
    recipe = load_recipe(ROOT / "recipes" / "pretrain.py")
    assert recipe.config_class is PretrainConfig and recipe.name == "pretrain"
    assert load_recipe("dpo").config().beta == 0.1
    with pytest.raises(ConfigError, match="unknown recipe 'ppo'"):
        load_recipe("ppo")


def test_the_building_blocks_are_importable_from_tunebook_with_docstrings():
    import tunebook

    for name in tunebook.__all__:
        if name != "__version__":
            assert (getattr(tunebook, name).__doc__ or "").strip(), f"tunebook.{name} has no docstring"
    assert callable(tunebook.pack_dataset) and callable(tunebook.step_loss_scale)
