"""Every shipped YAML parses: recipe configs into their dataclass, accelerate configs with Accelerate's classes."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ROOT

from tunebook.config import parse_config
from tunebook.recipe_configs import ClassifyConfig, PretrainConfig, SFTConfig

RECIPE_CONFIGS = sorted((ROOT / "recipes" / "configs").rglob("*.yaml"))
CONFIG_CLASSES = {"sft": SFTConfig, "classify": ClassifyConfig, "pretrain": PretrainConfig}
ACCELERATE_CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


def test_all_configs_are_found():
    assert len(RECIPE_CONFIGS) >= 4
    assert {p.name for p in ACCELERATE_CONFIGS} >= {"cpu.yaml", "multi_cpu.yaml", "single_gpu.yaml", "multi_gpu.yaml"}


@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_config_parses(path: Path):
    task = path.relative_to(ROOT / "recipes" / "configs").parts[0]
    config = parse_config(CONFIG_CLASSES[task], config_file=path)
    assert path.read_text().startswith("#"), "each config opens with a comment giving its launch command"
    assert "accelerate launch" in path.read_text().split("\n\n")[0]
    assert config.output_dir


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_loads(path: Path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.num_processes >= 1


def test_default_yaml_is_the_embedded_default():
    """The documented default must not drift from the dataclass defaults the recipe uses without --config."""
    from tunebook.models import TINY_LLAMA

    from_file = parse_config(SFTConfig, config_file=ROOT / "recipes/configs/sft/default.yaml")
    embedded = SFTConfig()
    assert from_file.model_config == TINY_LLAMA
    differing = {k for k in vars(embedded) if getattr(embedded, k) != getattr(from_file, k)}
    assert differing <= {"model_config", "max_seq_length", "generation_max_new_tokens"}


@pytest.mark.parametrize(
    "task, cls, model", [("classify", ClassifyConfig, "TINY_BERT"), ("pretrain", PretrainConfig, "TINY_LLAMA")]
)
def test_other_default_yamls_are_the_embedded_defaults(task, cls, model):
    import tunebook.models

    from_file = parse_config(cls, config_file=ROOT / f"recipes/configs/{task}/default.yaml")
    embedded = cls()
    assert from_file.model_config == getattr(tunebook.models, model)
    assert {k for k in vars(embedded) if getattr(embedded, k) != getattr(from_file, k)} == {"model_config"}
