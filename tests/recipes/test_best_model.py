"""Best checkpoint tracking, its protection from rotation, load_best_model_at_end and early stopping."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_TEST_MODEL, launch

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
    assert [r["step"] for r in rows] == [2, 4, 6, 6]  # three during training, then the final evaluation
    evals = {r["step"]: r for r in rows[:-1]}
    assert summary["train_steps"] == 6 and summary["stopped_early"]
    assert evals[2]["eval_loss"] > evals[4]["eval_loss"] > evals[6]["eval_loss"]
    best = summary["best"]
    assert best["metric"] == "eval_loss" and best["best_step"] == 2 and best["best_value"] == evals[2]["eval_loss"]
    # Rotation (save_total_limit 1) kept the newest checkpoint and the best one.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-6"]
    # The exported model is the best checkpoint's: its final evaluation repeats the step-2 one.
    assert summary["eval"]["eval_loss"] == pytest.approx(evals[2]["eval_loss"], abs=1e-6)
    assert rows[-1]["eval_loss"] == summary["eval"]["eval_loss"]
