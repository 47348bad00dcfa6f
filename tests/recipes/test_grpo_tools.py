"""recipes/grpo.py with tools: the offline tools default (recipes/configs/grpo/tools_default.yaml) learns to call
its calculator for products a tiny model cannot compute, and its logs say so."""

from __future__ import annotations

import json

import pytest
from support import ROOT

from tunebook import load_recipe
from tunebook.config import GRPOConfig, load_config

from recipe_runs import _records  # isort: skip


@pytest.mark.slow
@pytest.mark.timeout(1200)  # ~5 min on 2 free cores; the warm-up's 500 steps are most of it
def test_the_tools_default_learns_to_call_its_calculator(tmp_path, monkeypatch):
    """After the SFT warm-up (70% of its rows call the calculator, the rest answer directly, wrongly for the model),
    GRPO raises the rate of sampled episodes that call the tool and the exact match of their final answers; greedy
    episodes (which call already) keep their exact match. Measured on 2 cores (4.6 min in all, 3.7 of them the
    warm-up's 500 steps, during which copying the numbers emerges): call rate 0.66 -> 0.95, exact match of sampled
    episodes 0.45 -> 0.79, turns 1.65 -> 1.95 (first and last logging windows), held-out greedy 0.78 -> 0.80."""
    monkeypatch.chdir(ROOT)  # the YAML names its tool file from the repository's root, as its command runs there
    out = tmp_path / "tools"
    args = ["--config", "recipes/configs/grpo/tools_default.yaml", "--disable_tqdm", "true", "--output_dir", str(out)]
    load_recipe("grpo").main(load_config(GRPOConfig, args))  # in this process: the launch is the other tests'
    train = [r for r in _records(out) if "loss" in r]
    first, last = train[0], train[-1]
    assert {"tools/call_frequency", "tools/call_rate", "tools/failure_frequency", "episodes/turns",
            "episodes/truncated"} <= set(last)  # fmt: skip
    assert last["tools/call_rate"] >= first["tools/call_rate"] + 0.15, (first, last)
    assert last["rewards/exact_match/mean"] >= first["rewards/exact_match/mean"] + 0.15, (first, last)
    assert last["episodes/turns"] > first["episodes/turns"] and last["tools/failure_frequency"] < 0.05
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["eval_before_training"], summary["eval"]
    assert after["eval_exact_match"] >= max(0.7, before["eval_exact_match"] - 0.05), (before, after)
