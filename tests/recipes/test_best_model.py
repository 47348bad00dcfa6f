"""Best checkpoint tracking, its protection from rotation, load_best_model_at_end and early stopping."""

from __future__ import annotations

import json

import pytest
from support import TINY_TEST_MODEL, launch

pytestmark = pytest.mark.slow
ARGS = [
    "--model_config", json.dumps(TINY_TEST_MODEL),
    *"""--disable_tqdm true --synthetic_train_size 256 --synthetic_eval_size 16 --per_device_train_batch_size 8
    --learning_rate 3e-3 --eval_on_start false --generation_eval false --logging_steps 1""".split(),
]  # fmt: skip


def _evals(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval_loss" in r]


def test_early_stopping_and_the_best_checkpoint_become_the_final_model(tmp_path):
    # Training lowers the eval loss, so with greater_is_better the first evaluation stays the best: every later one
    # counts against the patience, and the run must stop after 2 of them, at step 6 of 20.
    out = tmp_path / "run"
    args = [*ARGS, "--max_steps", "20", "--eval_steps", "2", "--metric_for_best_model", "loss",
            "--greater_is_better", "true", "--early_stopping_patience", "2", "--load_best_model_at_end", "true",
            "--save_steps", "1", "--save_total_limit", "1", "--output_dir", str(out)]  # fmt: skip
    result = launch("recipes/sft.py", args)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = _evals(out)
    assert [r["step"] for r in rows] == [2, 4, 6]  # the run stopped right after step 6's evaluation: not repeated
    evals = {r["step"]: r for r in rows}
    assert summary["train_steps"] == 6 and summary["stopped_early"]
    assert evals[2]["eval_loss"] > evals[4]["eval_loss"] > evals[6]["eval_loss"]
    best = summary["best"]
    assert best["metric"] == "eval_loss" and best["best_step"] == 2 and best["best_value"] == evals[2]["eval_loss"]
    # Rotation (save_total_limit 1) kept the newest checkpoint and the best one.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-6"]
    # The exported model is the best checkpoint's, and the summary reports that model's evaluation.
    assert summary["eval"]["eval_loss"] == evals[2]["eval_loss"]


def test_the_final_step_competes_for_the_best_model(tmp_path):
    """With evaluations every 4 of 12 steps, the final step's own weights are evaluated before the best is chosen
    (they are the best here: the loss keeps falling), and keep their evaluation under their own step."""
    out = tmp_path / "run"
    args = [*ARGS, "--max_steps", "12", "--eval_steps", "4", "--load_best_model_at_end", "true",
            "--output_dir", str(out)]  # fmt: skip
    result = launch("recipes/sft.py", args)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    evals = {r["step"]: r for r in _evals(out)}
    assert sorted(evals) == [4, 8, 12] and evals[12]["eval_loss"] < evals[8]["eval_loss"]
    assert summary["best"]["best_step"] == 12
    assert summary["eval"]["eval_loss"] == evals[12]["eval_loss"]
    assert "Loaded the best checkpoint" not in result.stdout  # the final weights are the best: nothing to load
