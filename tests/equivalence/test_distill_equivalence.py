"""Distillation's step is one batch of its union: 4 accumulated micro-batches of 2, and 2 processes x 2 micro-batches
of 2, train the student as 1 process with batches of 8 does (the loss normalised by the loss tokens of the whole
step across micro-batches and processes; a per-micro-batch mean would not: the examples' completions differ in
length). The completions are the data's (`lmbda: 0`): sampled ones depend on which process samples them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from support import TINY_TEST_MODEL, launch

from tunebook import load_recipe

TOL = 1e-5
SETTINGS = {"model_config": TINY_TEST_MODEL, "teacher_model_config": {**TINY_TEST_MODEL, "hidden_size": 48},
            "teacher_warmup_steps": 0, "synthetic_train_size": 64, "synthetic_eval_size": 13, "max_steps": 3,
            "generation_eval": False, "lmbda": 0.0, "beta": 0.5, "alpha": 0.2, "learning_rate": 1e-3,
            "warmup_ratio": 0.0, "logging_steps": 1, "eval_on_start": False, "per_device_eval_batch_size": 4,
            "disable_tqdm": True, "report_to": "none", "dataloader_num_workers": 0, "log_level": "WARNING"}  # fmt: skip


def _in_process(out, batch: int, k: int) -> list[float]:
    recipe = load_recipe("distill")
    config = recipe.config(**SETTINGS, output_dir=str(out), cache_dir=str(out.parent / "cache"),
                           per_device_train_batch_size=batch, gradient_accumulation_steps=k)  # fmt: skip
    recipe.main(config)
    return _losses(out)


def _losses(out) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r and "eval_loss" not in r]


def _assert_same_model(a_dir, b_dir) -> None:
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=TOL, rtol=TOL, msg=f"parameter {name}")


def test_accumulated_micro_batches_train_as_one_batch_of_their_union(tmp_path):
    one = _in_process(tmp_path / "one", batch=8, k=1)
    four = _in_process(tmp_path / "four", batch=2, k=4)
    assert len(one) == 3 and four == pytest.approx(one, rel=TOL)
    _assert_same_model(tmp_path / "one", tmp_path / "four")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_train_as_one_batch_of_their_union(tmp_path):
    one = _in_process(tmp_path / "one", batch=8, k=1)
    args = [f"--{key}={json.dumps(value) if isinstance(value, dict) else value}" for key, value in SETTINGS.items()]
    args += ["--output_dir", str(tmp_path / "two"), "--cache_dir", str(tmp_path / "cache"),
             "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]  # fmt: skip
    result = launch("recipes/distill.py", args, accelerate_config="multi_cpu.yaml")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["num_processes"] == 2
    assert _losses(tmp_path / "two") == pytest.approx(one, rel=TOL)
    _assert_same_model(tmp_path / "one", tmp_path / "two")
