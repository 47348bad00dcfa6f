"""The real models' configs in recipes/configs/ and the `config.json` files they are planned against.

Each shipped `tests/assets/model_configs/<org>--<name>/config.json` builds, on the meta device (no memory, no
weights), a model with the published parameter count: a wrong size, head count, vocabulary or tied head shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import ASSETS

MODEL_CONFIGS = ASSETS / "model_configs"

# Parameters as the Hub's model pages state them (billions, to their precision).
PUBLISHED_BILLIONS = {
    "meta-llama/Llama-3.1-8B-Instruct": 8.03,
    "Qwen/Qwen3-8B": 8.19,
    "Qwen/Qwen2.5-7B-Instruct": 7.62,
    "HuggingFaceTB/SmolLM3-3B": 3.08,
    "google/gemma-3-4b-it": 4.30,  # the language model and its SigLIP vision tower
    "meta-llama/Llama-3.2-3B-Instruct": 3.21,
    "Qwen/Qwen2.5-1.5B-Instruct": 1.54,
    "meta-llama/Llama-3.2-1B": 1.24,
}


def asset(model: str) -> Path:
    """The shipped config.json directory of a Hub model name."""
    return MODEL_CONFIGS / model.replace("/", "--")


def test_every_asset_is_listed():
    shipped = {p.name for p in MODEL_CONFIGS.iterdir() if p.is_dir()}
    assert shipped == {asset(m).name for m in PUBLISHED_BILLIONS}


@pytest.mark.parametrize("model", PUBLISHED_BILLIONS)
def test_config_builds_the_published_model(model):
    import torch
    from transformers import AutoConfig

    from tunebook.models.vision import generative_auto_class

    config = AutoConfig.from_pretrained(asset(model))
    assert config.architectures == json.loads((asset(model) / "config.json").read_text())["architectures"]
    with torch.device("meta"):  # shapes only: an 8B model in no memory, in about a second
        built = generative_auto_class(config).from_config(config)
    assert type(built).__name__ == config.architectures[0]  # the class the recipes load the weights into
    parameters = sum(p.numel() for p in built.parameters())
    assert round(parameters / 1e9, 2) == PUBLISHED_BILLIONS[model]
