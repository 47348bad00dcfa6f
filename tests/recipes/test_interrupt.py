"""Preemption and crashes lose nothing: a real SIGTERM mid-run saves a checkpoint the run resumes from exactly,
and a `kill -9` during a save leaves `latest` on the previous complete checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from support import ROOT, TINY_TEST_MODEL, launch

pytestmark = pytest.mark.slow
ARGS = [
    "--model_config", json.dumps(TINY_TEST_MODEL),
    *"""--disable_tqdm true --synthetic_train_size 200 --synthetic_eval_size 4 --max_steps 300 --logging_steps 1
    --per_device_train_batch_size 4 --eval_on_start false --generation_eval false --save_steps 0""".split(),
]  # fmt: skip


def _losses(out):
    return {
        r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    }


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_saves_and_the_resumed_run_matches_an_uninterrupted_one(tmp_path, signum):
    full = tmp_path / "full"
    assert launch("recipes/sft.py", [*ARGS, "--output_dir", str(full)]).returncode == 0

    out = tmp_path / "preempted"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--quiet",
        "--config_file",
        str(ROOT / "accelerate_configs/cpu.yaml"),
        str(ROOT / "recipes/sft.py"),
        *ARGS,
        "--output_dir",
        str(out),
    ]
    # A session of its own, signalled as a whole, as SLURM signals a job step and Ctrl-C a terminal's foreground.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline and len(_losses(out) if (out / "metrics.jsonl").exists() else {}) < 20:
        time.sleep(0.05)
    trainer = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signum)
    psutil.wait_procs(trainer, timeout=120)
    output = proc.stdout.read()
    proc.wait()
    assert "Resume with the same command plus --resume_from_checkpoint latest" in output, output[-3000:]
    assert "Stopped at step" in output and f"by signal {int(signum)}" in output
    stopped = sorted(out.glob("checkpoints/step-*"))
    assert len(stopped) == 1 and not (out / "model.safetensors").exists()
    step = int(stopped[0].name.split("-")[1])
    assert 20 <= step < 300

    resumed = launch("recipes/sft.py", [*ARGS, "--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(out) == _losses(full)
    assert (out / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()


SLOW_SAVE = """
import sys, time
from pathlib import Path
import torch
from accelerate import Accelerator
from tunebook.training.checkpoint import save_checkpoint
from tunebook.config import parse_config
from tunebook.config import SFTConfig

out, step = Path(sys.argv[1]), int(sys.argv[2])
accelerator = Accelerator(cpu=True)
model = accelerator.prepare(torch.nn.Linear(4, 4))
if step > 1:  # the slow save: killed while Accelerate writes the model
    real = accelerator.save_state
    def slow(path, **kwargs):
        real(path, **kwargs)
        print("written, not yet renamed", flush=True)
        time.sleep(60)
    accelerator.save_state = slow
save_checkpoint(accelerator, out, step, parse_config(SFTConfig), {"epoch": 0, "batches_in_epoch": step}, keep=0)
"""


def test_kill_9_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    from tunebook.training.checkpoint import load_trainer_state, resolve_checkpoint

    script = tmp_path / "save.py"
    script.write_text(SLOW_SAVE)
    assert subprocess.run([sys.executable, str(script), str(tmp_path), "1"], cwd=ROOT).returncode == 0
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), "2"], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)  # fmt: skip
    assert proc.stdout.readline().strip() == "written, not yet renamed"
    proc.kill()  # SIGKILL: no handler, no cleanup
    proc.wait()
    assert (tmp_path / "checkpoints" / "step-2.tmp").is_dir()  # the half-done save is there...
    latest = resolve_checkpoint(tmp_path, "latest")  # ...but never taken for a checkpoint
    assert latest.name == "step-1" and load_trainer_state(latest)["global_step"] == 1
