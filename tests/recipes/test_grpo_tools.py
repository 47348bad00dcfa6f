"""recipes/grpo.py with tools: the offline tools default (recipes/configs/grpo/tools_default.yaml) learns to call
its calculator for products a tiny model cannot compute, and its logs say so."""

from __future__ import annotations

import json

import pytest
from support import launch

from recipe_runs import _records  # isort: skip


@pytest.mark.slow
def test_the_tools_default_learns_to_call_its_calculator(tmp_path):
    """After the SFT warm-up (70% of its rows call the calculator, the rest answer directly, wrongly for the model), GRPO raises
    the rate of sampled episodes that call the tool and the exact match of their final answers, and the held-out
    exact match of greedy episodes. The tool's results reach the model as tool messages between its turns."""
    out = tmp_path / "tools"
    args = ["--config", "recipes/configs/grpo/tools_default.yaml", "--disable_tqdm", "true", "--output_dir", str(out)]
    result = launch("recipes/grpo.py", args, timeout=900, launcher="accelerate")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    train = [r for r in _records(out) if "loss" in r]
    first, last = train[0], train[-1]
    assert {"tools/call_frequency", "tools/call_rate", "tools/failure_frequency", "episodes/turns",
            "episodes/truncated"} <= set(last)  # fmt: skip
    assert last["tools/call_rate"] >= first["tools/call_rate"] + 0.2, (first, last)
    assert last["rewards/exact_match/mean"] >= first["rewards/exact_match/mean"] + 0.2, (first, last)
    assert last["episodes/turns"] > first["episodes/turns"]
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["eval_before_training"], summary["eval"]
    assert after["eval_exact_match"] >= before["eval_exact_match"] + 0.2, (before, after)
