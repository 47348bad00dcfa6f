"""A run resumed from a checkpoint is the same run: bit-identical losses and final weights on CPU in fp32.

The uninterrupted run saves a checkpoint every 3 steps and keeps them all; each checkpoint is exactly the state an
interrupted run would have left there. Resuming a copy of the run directory from step 3 (in the middle of the
first epoch) and from step 6 (in the middle of the second) must log, at every later step, the same loss as the
uninterrupted run, and end with the same weights, byte for byte. With shuffling, gradient accumulation over
micro-batches of different lengths, packing, length grouping, LoRA (adapter-only checkpoints), and 2 processes.
"""

from __future__ import annotations

import json
import shutil

import pytest
from support import TINY_TEST_MODEL, launch

pytestmark = pytest.mark.slow
COMMON = [
    "--model_config", json.dumps(TINY_TEST_MODEL),
    *"""--disable_tqdm true --synthetic_train_size 40 --synthetic_eval_size 4 --max_steps 8 --logging_steps 1
    --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --eval_on_start false --generation_eval false
    --save_steps 3 --save_total_limit 0 --learning_rate 2e-3 --warmup_ratio 0.2""".split(),
]  # fmt: skip


def _losses(out):
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), f"metrics.jsonl repeats or reorders steps: {steps}"
    return {r["step"]: r["loss"] for r in records}


def _check(tmp_path, extra, accelerate_config="cpu.yaml"):
    full = tmp_path / "full"
    result = launch(
        "recipes/sft.py", [*COMMON, *extra, "--output_dir", str(full)], accelerate_config=accelerate_config
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reference = _losses(full)
    assert sorted(reference) == list(range(1, 9))
    assert json.loads((full / "checkpoints/step-3/trainer_state.json").read_text())["epoch"] == 0
    assert json.loads((full / "checkpoints/step-6/trainer_state.json").read_text())["epoch"] == 1
    for step in (3, 6):
        run = tmp_path / f"resumed-{step}"
        shutil.copytree(full, run)
        for later in run.glob("checkpoints/step-*"):
            if int(later.name.split("-")[1]) > step:
                shutil.rmtree(later)  # what an interruption after `step` would have left
        args = [*COMMON, *extra, "--output_dir", str(run), "--resume_from_checkpoint", "latest"]
        result = launch("recipes/sft.py", args, accelerate_config=accelerate_config)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert f"Resumed from {run / 'checkpoints' / f'step-{step}'}" in result.stdout
        assert _losses(run) == reference  # every step once, the same losses to the last bit
        weights = "adapter_model.safetensors" if "--use_peft" in extra else "model.safetensors"
        assert (run / weights).read_bytes() == (full / weights).read_bytes()


@pytest.mark.parametrize(
    "extra",
    [[], ["--packing", "true", "--max_seq_length", "64"], ["--group_by_length", "true"], ["--use_peft", "true"]],
    ids=["shuffled", "packed", "length-grouped", "lora"],
)  # fmt: skip
def test_resume_is_bit_identical(tmp_path, extra):
    _check(tmp_path, extra)


@pytest.mark.multiprocess
def test_two_process_resume_is_bit_identical(tmp_path):
    _check(tmp_path, ["--per_device_train_batch_size", "2"], accelerate_config="multi_cpu.yaml")
