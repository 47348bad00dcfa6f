"""The real models' configs in recipes/configs/ and the `config.json` files they are planned against.

Each shipped `tests/assets/model_configs/<org>--<name>/config.json` builds, on the meta device (no memory, no
weights), a model with the published parameter count: a wrong size, head count, vocabulary or tied head shows. Each
config whose header names the hardware it was planned for (a `#   tunebook plan ...` line) fits that hardware by
the planner, run on that line with its model's config.json, and the figures its header states are the plan's now.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from support import ASSETS, ROOT

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
    "Qwen/Qwen2.5-0.5B-Instruct": 0.49,
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


# Configs planned for named hardware: the line a reader runs, and the figures it gave, in the header.
PLANNED = sorted(p for p in (ROOT / "recipes" / "configs").rglob("*.yaml") if "\n#   tunebook plan " in p.read_text())
PLAN_LINE = re.compile(r"^#   tunebook (plan .*)$", re.MULTILINE)
FIGURES = re.compile(r"^# Planned \(tunebook plan, [0-9-]+\): ([0-9.]+) GiB of ([0-9.]+) GiB per GPU", re.MULTILINE)


def test_the_real_model_configs_are_planned():
    assert len(PLANNED) >= 13
    models = {yaml.safe_load(p.read_text())[key] for p in PLANNED for key in ("model_name_or_path", "teacher_model_name_or_path")
              if key in yaml.safe_load(p.read_text())}  # fmt: skip
    assert models == set(PUBLISHED_BILLIONS), "each shipped config.json serves a planned config, and each back"


@pytest.mark.slow  # the planner traces a whole step of the model on fake tensors: 5-25 s per config on 2 CPU cores
@pytest.mark.parametrize("path", PLANNED, ids=lambda p: str(p.relative_to(ROOT / "recipes" / "configs")))
def test_config_fits_the_hardware_its_header_names(path: Path):
    from tunebook.cli.main import main

    text = path.read_text()
    header = text.split("\n\n")[0]
    line = PLAN_LINE.search(header)
    figures = FIGURES.search(header)
    assert line and figures, "the header's first paragraph holds the plan line and the plan's figures"
    argv = shlex.split(line.group(1))
    recipe = path.relative_to(ROOT / "recipes" / "configs").parts[0]
    assert argv[:4] == ["plan", recipe, "--config", str(path.relative_to(ROOT))]
    assert "--gpu" in argv and "--num_gpus" in argv, "the hardware it was planned for, named"
    values = yaml.safe_load(text)
    model, teacher = values["model_name_or_path"], values.get("teacher_model_name_or_path")  # distill's teacher
    shapes = [
        "--architecture",
        str(asset(model)),
        *(["--teacher_architecture", str(asset(teacher))] if teacher else []),
    ]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        main([*argv, *shapes, "--json"])
    plan = json.loads(stdout.getvalue().strip().splitlines()[-1])
    gib = 2**30
    assert plan["fits"], (
        f"{plan['total'] / gib:.1f} GiB of {plan['device_memory'] / gib:.1f}: {plan['recommendation']}"
    )
    stated, device = float(figures.group(1)), float(figures.group(2))
    assert stated == pytest.approx(plan["total"] / gib, rel=0.05), "the header's figures are stale: plan again"
    assert device == pytest.approx(plan["device_memory"] / gib, abs=0.05)
