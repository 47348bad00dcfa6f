"""Run a recipe from Python: a notebook, a test or your own script, with the code `accelerate launch` runs.

    from tunebook import load_recipe

    sft = load_recipe("sft")                       # or another name of RECIPES, or a recipe file
    config = sft.config(max_steps=100, learning_rate=1e-3)           # keyword overrides, checked like the CLI
    config = sft.config("recipes/configs/sft/default.yaml", seed=1)  # a YAML file, then overrides
    summary = sft.main(config)                     # trains in this process; returns what summary.json holds

The recipes are the files in `recipes/`. In a checkout or an editable install they are that folder; an
installed wheel carries them as the package `tunebook.recipes` (pyproject maps the folder there).
Importing a recipe has no side effects: it trains only when `main` is called, and leaves the process's hooks,
root logger and garbage collector as they were (tests/unit/test_side_effects.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import typing
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from .config import parse_config
from .errors import ConfigError

__all__ = ["RECIPES", "Recipe", "load_recipe", "recipe_config_class", "recipe_data", "recipe_file", "recipe_task"]

# The one map of recipe names: each recipe's config class (in tunebook.config) and data preparation (in
# tunebook.data), by name, so neither the recipe nor torch is imported to check a command line; and what it trains
# with the Hub's pipeline tag of its model (for model cards).
_PARTS = {
    "sft": ("SFTConfig", "data:prepare_sft_or_vision_data",
            "supervised fine-tuning (SFT) of a causal language model on instruction or chat data", "text-generation"),
    "classify": ("ClassifyConfig", "data:prepare_classification_data", "fine-tuning of a text classifier",
                 "text-classification"),
    "pretrain": ("PretrainConfig", "data:prepare_text_data",
                 "continued pretraining of a causal language model on plain text", "text-generation"),
    "dpo": ("DPOConfig", "preference:prepare_preference_or_vision_data",
            "Direct Preference Optimization (DPO) of a causal language model on preference pairs", "text-generation"),
    "kto": ("KTOConfig", "preference:prepare_kto_data",
            "Kahneman-Tversky Optimization (KTO) of a causal language model on completions labelled desirable or not",
            "text-generation"),
    "reward": ("RewardConfig", "preference:prepare_preference_data",
               "a reward model (one-output sequence classifier) trained on preference pairs", "text-classification"),
    "grpo": ("GRPOConfig", "rl:prepare_prompt_data",
             "Group Relative Policy Optimization (GRPO) of a causal language model with reward functions",
             "text-generation"),
    "distill": ("DistillConfig", "data:prepare_sft_data",
                "knowledge distillation (GKD) of a causal language model from a teacher sharing its tokenizer",
                "text-generation"),
}  # fmt: skip
RECIPES = tuple(_PARTS)


def _part(name: str, index: int) -> str:
    if name not in _PARTS:
        raise ConfigError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    return _PARTS[name][index]


def recipe_config_class(name: str) -> type:
    """The config class of recipe `name`, without importing the recipe (and torch): what the CLI checks a
    command line against before launching, and what `tunebook prepare`/`export` read configs with."""
    from . import config as configs

    return getattr(configs, _part(name, 0))


def recipe_data(name: str):
    """The function that prepares recipe `name`'s data (`prepare(config, cache_dir, log)`): what the recipe runs first
    and `tunebook prepare` runs alone."""
    package, function = _part(name, 1).split(":")  # the task's package under tunebook, and its function
    return getattr(importlib.import_module(f"tunebook.{package}"), function)


def recipe_task(name: str) -> tuple[str, str] | None:
    """(what recipe `name` trains, the Hub's pipeline tag of its model), or None for a recipe of one's own."""
    return _PARTS[name][2:] if name in _PARTS else None


def recipe_file(name: str) -> Path:
    """The file of recipe `name` (`recipes/<name>.py`, which an installed wheel carries as `tunebook.recipes`)."""
    return Path(__file__).resolve().parent / "recipes" / f"{name}.py"


@dataclass(frozen=True)
class Recipe:
    """A loaded recipe: its module, its config class, and `config(...)` / `main(config)` to use them."""

    name: str
    module: ModuleType
    config_class: type

    def config(self, config_file: str | Path | None = None, **overrides: Any):
        """The recipe's config: dataclass defaults < `config_file` (YAML) < `overrides`, validated."""
        return parse_config(self.config_class, config_file, overrides, "config(...) arguments")

    def main(self, config) -> dict[str, Any]:
        """Train (and evaluate) in this process; returns the run's summary."""
        if not isinstance(config, self.config_class):
            raise ConfigError(
                f"recipe {self.name!r} takes a {self.config_class.__name__}, got {type(config).__name__}: "
                f"build it with load_recipe({self.name!r}).config(...)"
            )
        return self.module.main(config)


def load_recipe(name_or_path: str | Path) -> Recipe:
    """The recipe `name_or_path`: one of `RECIPES`, or the path of a recipe file with a `main(config)`."""
    path = Path(name_or_path)
    if str(name_or_path) in RECIPES:
        module = importlib.import_module(f"tunebook.recipes.{name_or_path}")
    elif path.suffix == ".py" and path.is_file():
        spec = importlib.util.spec_from_file_location(f"tunebook_recipe_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        raise ConfigError(
            f"unknown recipe {str(name_or_path)!r}: use one of {', '.join(RECIPES)} or a recipe .py file"
        )
    if not callable(getattr(module, "main", None)):
        raise ConfigError(f"{module.__file__} has no main(config) function")
    config_class = typing.get_type_hints(module.main).get("config")
    if config_class is None:
        raise ConfigError(f"{module.__file__}: main's `config` parameter needs a type annotation (its config class)")
    return Recipe(path.stem if path.suffix == ".py" else str(name_or_path), module, config_class)
