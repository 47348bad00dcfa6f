"""Checkpoint export, rotation, and what a non-finite loss does under each nan_policy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import ROOT, TINY_TEST_MODEL, launch

pytestmark = pytest.mark.slow
TUNEBOOK = str(Path(sys.executable).parent / "tunebook")
ARGS = [
    "--model_config", json.dumps(TINY_TEST_MODEL),
    *"""--disable_tqdm true --synthetic_train_size 64 --synthetic_eval_size 4 --per_device_train_batch_size 4
    --eval_on_start false --generation_eval false""".split(),
]  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize("accelerate_config", ["cpu.yaml", "multi_cpu.yaml"])
def test_export_of_the_last_checkpoint_equals_the_final_model(tmp_path, accelerate_config):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    args = [*ARGS, "--max_steps", "4", "--save_steps", "2", "--save_total_limit", "1", "--output_dir", str(out)]
    result = launch("recipes/sft.py", args, accelerate_config=accelerate_config)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-4"]  # rotation kept the newest only
    exported = tmp_path / "exported"
    done = subprocess.run([TUNEBOOK, "export", str(out / "checkpoints/step-4"), str(exported)], capture_output=True,
                          text=True, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    final, again = load_file(out / "model.safetensors"), load_file(exported / "model.safetensors")
    assert final.keys() == again.keys()
    for name in final:
        torch.testing.assert_close(again[name], final[name], atol=0, rtol=0)
    AutoModelForCausalLM.from_pretrained(exported)
    assert AutoTokenizer.from_pretrained(exported).chat_template


def test_export_refuses_what_is_not_a_checkpoint(tmp_path):
    done = subprocess.run([TUNEBOOK, "export", str(tmp_path), str(tmp_path / "x")], capture_output=True, text=True)
    assert done.returncode != 0 and "is not a complete Tunebook checkpoint" in done.stderr
    assert "Traceback" not in done.stderr


def test_nan_policy_stop_exits_with_the_step_and_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "diverged"
    args = [*ARGS, "--learning_rate", "1e30", "--max_grad_norm", "0", "--max_steps", "6", "--save_steps", "1",
            "--output_dir", str(out)]  # fmt: skip
    result = launch("recipes/sft.py", args, in_process=False)  # the exit code and the one line, seen from outside
    assert result.returncode != 0
    error = [line for line in result.stderr.splitlines() if line.startswith("tunebook: error: non-finite loss")]
    assert len(error) == 1 and "Last good checkpoint:" in error[0] and "Traceback" not in result.stderr
    saved = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").iterdir())
    assert f"at step {saved[-1] + 1}; nothing was saved" in error[0]  # the bad step saved nothing


def test_nan_policy_skip_drops_the_updates_and_counts_them(tmp_path):
    out = tmp_path / "skipped"
    args = [*ARGS, "--learning_rate", "1e30", "--max_grad_norm", "0", "--max_steps", "4", "--nan_policy", "skip",
            "--output_dir", str(out)]  # fmt: skip
    result = launch("recipes/sft.py", args)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert 1 <= summary["skipped_updates"] <= 3 and summary["train_steps"] == 4
    assert "update skipped" in result.stdout


def test_save_strategy_epoch_saves_at_every_epoch_end(tmp_path):
    out = tmp_path / "epochs"
    args = [*ARGS, "--num_train_epochs", "2", "--save_strategy", "epoch", "--save_steps", "1", "--save_total_limit",
            "0", "--output_dir", str(out)]  # fmt: skip
    result = launch("recipes/sft.py", args)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = {p.name: json.loads((p / "trainer_state.json").read_text()) for p in (out / "checkpoints").iterdir()}
    assert sorted(saved) == ["step-16", "step-32"]  # 64 examples / batch 4 = 16 steps per epoch; save_steps ignored
    assert [s["epoch"] for _, s in sorted(saved.items())] == [0, 1]


def test_convert_gguf_names_a_missing_file(tmp_path):
    missing = tmp_path / "model.gguf"
    done = subprocess.run([TUNEBOOK, "convert-gguf", str(missing), str(tmp_path / "out")], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode != 0 and f"GGUF file not found: {missing}" in done.stderr
    assert "Traceback" not in done.stderr
