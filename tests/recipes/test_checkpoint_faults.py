"""Damaged checkpoints and a full disk, on every recipe (in-process, tiny, as tests/recipes/test_guarantees.py), and
through the real launcher (one line, a non-zero exit, on one and on two processes, and on a real small filesystem
where this machine lets a test mount one):

- `latest` passes over damaged checkpoints (each of the faults seen in the field, one per checkpoint) to the newest
  intact one, warning for each what is wrong, and the resumed run ends with the uninterrupted run's weights; a
  damaged checkpoint named by its path stops the run;
- a damaged RNG state in a checkpoint without a manifest (an earlier Tunebook's) stops the resume instead of passing;
- a save whose writes fail for lack of space stops the run with one line, leaves no partial folder, and the run
  resumes from the checkpoint before it to the uninterrupted run's weights.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from support import TINY_TEST_MODEL, launch, launch_command

from tunebook.errors import TrainingError
from tunebook.recipe import RECIPES
from tunebook.training.checkpoint import list_checkpoints
from tunebook.training.manifest import verify_checkpoint

from recipe_runs import _run, _weights  # isort: skip

pytestmark = pytest.mark.slow
LOG = logging.getLogger("tunebook")
SAVES = {"max_steps": 7, "save_steps": 1, "save_total_limit": 0}  # a checkpoint at every step


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _scramble(path: Path) -> None:
    """Other bytes, the same size: only the checksum tells."""
    path.write_bytes(bytes(b ^ 0x5A for b in path.read_bytes()))


# The faults of issue 42, newest checkpoint first: (file, damage, what the warning says is wrong).
FAULTS = [
    ("model.safetensors", _truncate, "size of model.safetensors is"),
    ("optimizer.bin", _truncate, "size of optimizer.bin is"),
    ("trainer_state.json", _scramble, "checksum mismatch of trainer_state.json"),
    ("process_state_0.json", lambda path: path.write_text("garbage"), "size of process_state_0.json is"),
    ("model.safetensors", Path.unlink, "missing file model.safetensors"),  # resume named a pytorch_model.bin
    ("random_states_0.pkl", _scramble, "checksum mismatch of random_states_0.pkl"),  # resume went on silently
]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """`full_run(name)`: the uninterrupted run of recipe `name` with a checkpoint at every step, run once."""
    runs, cache = {}, tmp_path_factory.mktemp("cache")

    def run(name):
        if name not in runs:
            runs[name] = tmp_path_factory.mktemp(f"full-{name}")
            _run(name, runs[name], cache, **SAVES)
        return runs[name], cache

    return run


def _copy(full: Path, out: Path) -> Path:
    shutil.copytree(full, out)
    (out / "model.safetensors").unlink()  # written again by the resumed run, or the comparison proves nothing
    return out


@pytest.mark.parametrize("name", RECIPES)
def test_latest_falls_back_past_damaged_checkpoints_to_the_same_result(name, tmp_path, full_run, capsys):
    full, cache = full_run(name)
    out = _copy(full, tmp_path / "run")
    for step, (file, damage, _) in zip(range(7, 1, -1), FAULTS):
        damage(out / "checkpoints" / f"step-{step}" / file)
    with pytest.raises(TrainingError, match=r"^resume_from_checkpoint: checkpoint .*step-7 is damaged: size of model"):
        _run(name, out, cache, **SAVES, resume_from_checkpoint=str(out / "checkpoints" / "step-7"))
    capsys.readouterr()

    summary = _run(name, out, cache, **SAVES, resume_from_checkpoint="latest")
    log = capsys.readouterr().out
    for step, (_, _, problem) in zip(range(7, 1, -1), FAULTS):
        assert f"Checkpoint {out}/checkpoints/step-{step} is damaged ({problem}" in log, log[-3000:]
    assert log.count("resuming from step-1, the newest intact one") == 6
    assert summary["resumed_from"].endswith("step-1") and summary["train_steps"] == 7
    assert _weights(out) == _weights(full)
    assert [p.name for p in list_checkpoints(out)] == [f"step-{s}" for s in range(1, 8)]  # saved again, intact
    assert all(verify_checkpoint(p, LOG) is None for p in list_checkpoints(out))
    assert sorted(p.name for p in (out / "checkpoints").glob("*.damaged")) == [
        f"step-{s}.damaged" for s in range(2, 8)
    ]


@pytest.mark.parametrize("name", RECIPES)
def test_an_unreadable_rng_state_stops_the_resume_even_without_a_manifest(name, tmp_path, full_run, capsys):
    """Accelerate's load_state swallows the error: the run went on, with other random numbers, and exit 0."""
    full, cache = full_run(name)
    out = _copy(full, tmp_path / "run")
    (out / "checkpoints" / "step-7" / "manifest.json").unlink(missing_ok=True)  # as saved before manifests
    _scramble(out / "checkpoints" / "step-7" / "random_states_0.pkl")
    with pytest.raises(TrainingError, match=r"step-7/random_states_0.pkl: the random number generators' state "
                                            r"cannot be restored \(UnpicklingError"):  # fmt: skip
        _run(name, out, cache, **SAVES, resume_from_checkpoint="latest")
    assert "step-7 has no manifest.json (saved by an earlier Tunebook): its files are not verified" in (
        capsys.readouterr().out
    )


Usage = namedtuple("Usage", "total used free")


@pytest.mark.parametrize("name", RECIPES)
def test_a_full_disk_during_a_save_stops_the_run_and_it_resumes_to_the_same_result(name, tmp_path, full_run,
                                                                                   monkeypatch):  # fmt: skip
    """The disk fills while the optimizer state of step 4's checkpoint is written: torch.save fails as it does
    there, with a stream error that names no cause, and the disk then has no room left."""
    full, cache = full_run(name)
    out, real_save, real_usage, filled = tmp_path / "run", torch.save, shutil.disk_usage, []

    def save(obj, f, *args, **kwargs):
        if "step-4.tmp" in str(f):
            filled.append(f)
            raise RuntimeError("basic_ios::clear: iostream error")
        return real_save(obj, f, *args, **kwargs)

    # Full only where the run writes: datasets binds `shutil.disk_usage` when its py_utils is first imported, which
    # may be inside this patch, and would otherwise find every later test's cache full.
    def disk_usage(path):
        usage = real_usage(path)
        return Usage(usage.total, usage.total, 0) if filled and Path(path).resolve().is_relative_to(out) else usage

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", save)
        patch.setattr(shutil, "disk_usage", disk_usage)
        with pytest.raises(TrainingError) as error:
            _run(name, out, cache, **SAVES)
    needed = json.loads((out / "checkpoints" / "step-3" / "manifest.json").read_text())["total_bytes"]
    assert str(error.value).startswith(
        f"no space left on device: checkpoint {out}/checkpoints/step-4 needs {needed} bytes ("
    ) and str(error.value).endswith(
        "0 bytes free; the partial step-4.tmp was removed; earlier checkpoints are kept (newest: step-3)"
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1", "step-2", "step-3"]
    assert verify_checkpoint(out / "checkpoints" / "step-3", LOG) is None
    assert not (out / "model.safetensors").exists()

    summary = _run(name, out, cache, **SAVES, resume_from_checkpoint="latest")
    assert summary["resumed_from"].endswith("step-3") and _weights(out) == _weights(full)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", RECIPES)
def test_a_full_disk_at_the_final_save_is_one_line_naming_the_checkpoint_to_export(name, lora, tmp_path,
                                                                                  monkeypatch):  # fmt: skip
    """The final model's weights (safetensors, through transformers or peft) find the disk full: one line that says
    how to write the model once there is room, from the last checkpoint, which is intact; the model is freed."""
    import safetensors.torch

    if lora:
        pytest.importorskip("peft")
    out, real_usage, filled = tmp_path / "run", shutil.disk_usage, []
    real_save_file = safetensors.torch.save_file

    def save_file(tensors, filename, *args, **kwargs):
        if Path(filename).parent == out:  # the final model's weights, not a checkpoint's
            filled.append(filename)
            raise safetensors.SafetensorError(
                'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on '
                'device" })'
            )
        return real_save_file(tensors, filename, *args, **kwargs)

    # Full only where the run writes: datasets binds `shutil.disk_usage` when its py_utils is first imported, which
    # may be inside this patch, and would otherwise find every later test's cache full.
    def disk_usage(path):
        usage = real_usage(path)
        return Usage(usage.total, usage.total, 0) if filled and Path(path).resolve().is_relative_to(out) else usage

    import transformers.modeling_utils

    with monkeypatch.context() as patch:
        patch.setattr(transformers.modeling_utils, "safe_save_file", save_file)
        if lora:  # peft writes the adapters itself
            import peft.peft_model

            patch.setattr(peft.peft_model, "safe_save_file", save_file)
        patch.setattr(shutil, "disk_usage", disk_usage)
        with pytest.raises(TrainingError) as error:
            _run(name, out, tmp_path / "cache", max_steps=2, save_steps=2, use_peft=lora)
    assert filled
    message = str(error.value)
    assert message.startswith(f"no space left on device: the final model in {out} needs ") and message.endswith(
        f", 0 bytes free; free some space, then write it from the last checkpoint: tunebook export "
        f"{out}/checkpoints/step-2 {out}"
    ), message
    assert verify_checkpoint(out / "checkpoints" / "step-2", LOG) is None
    assert not (out / "summary.json").exists()


# --- through the launcher: the one line and the exit code, as a user sees them

ARGS = ["--model_config", json.dumps(TINY_TEST_MODEL), "--synthetic_train_size", "64", "--synthetic_eval_size", "4",
        "--per_device_train_batch_size", "4", "--eval_on_start", "false", "--generation_eval", "false",
        "--disable_tqdm", "true", "--report_to", "none", "--log_level", "WARNING"]  # fmt: skip


def _errors(result) -> list[str]:
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-3000:]
    return [line for line in output.splitlines() if line.startswith("tunebook: error")]


def test_a_damaged_checkpoint_named_by_its_path_is_one_line_and_a_non_zero_exit(tmp_path):
    out = tmp_path / "run"
    args = [*ARGS, "--max_steps", "2", "--save_steps", "1", "--output_dir", str(out)]
    assert launch("recipes/sft.py", args).returncode == 0
    _truncate(out / "checkpoints" / "step-2" / "optimizer.bin")
    step_2 = out / "checkpoints" / "step-2"
    result = launch("recipes/sft.py", [*args, "--resume_from_checkpoint", str(step_2)], in_process=False)
    assert result.returncode == 1
    assert _errors(result) == [
        f"tunebook: error: resume_from_checkpoint: checkpoint {step_2} is damaged: size of optimizer.bin is "
        f"{(step_2 / 'optimizer.bin').stat().st_size} bytes, the manifest says "
        f"{2 * (step_2 / 'optimizer.bin').stat().st_size}"
    ]


@pytest.mark.multiprocess
def test_a_full_disk_on_one_of_two_processes_stops_both_with_one_line(tmp_path):
    """Process 1 cannot write its RNG state into step 2's checkpoint; process 0 wrote its part: both learn it, both
    stop with the same line (printed once), neither waits for the other, and step 1 is kept. Both then resume from
    it; and past a damaged checkpoint (process 1's RNG state), both from the same one, verified once."""
    out = tmp_path / "run"
    args = [*ARGS, "--max_steps", "4", "--save_steps", "1", "--output_dir", str(out)]
    result = launch("tests/recipes/disk_full_at_save.py", args, accelerate_config="multi_cpu.yaml",
                    env={"DISK_FULL_AT_STEP": "2", "DISK_FULL_RANK": "1"}, timeout=300)  # fmt: skip
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    errors = _errors(result)
    assert len(errors) == 1 and errors[0].startswith(
        f"tunebook: error (rank 0): no space left on device (process 1): checkpoint {out}/checkpoints/step-2 needs "
    ), errors
    assert errors[0].endswith("the partial step-2.tmp was removed; earlier checkpoints are kept (newest: step-1)")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]
    assert verify_checkpoint(out / "checkpoints" / "step-1", LOG) is None

    resume = ["--resume_from_checkpoint", "latest"]
    resumed = launch("recipes/sft.py", [*args, *resume], accelerate_config="multi_cpu.yaml", timeout=300)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert json.loads((out / "summary.json").read_text())["resumed_from"].endswith("step-1")
    _scramble(out / "checkpoints" / "step-4" / "random_states_1.pkl")
    longer = [*ARGS, "--max_steps", "5", "--save_steps", "1", "--output_dir", str(out), *resume]
    resumed = launch("recipes/sft.py", longer, accelerate_config="multi_cpu.yaml", timeout=300)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    warning = f"Checkpoint {out}/checkpoints/step-4 is damaged (checksum mismatch of random_states_1.pkl): resuming"
    assert output.count(warning) == 1, output[-3000:]
    assert json.loads((out / "summary.json").read_text())["resumed_from"].endswith("step-3")


def _can_mount_tmpfs(directory: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs '{directory}'"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def test_a_real_full_filesystem_is_one_line_and_keeps_the_checkpoint_before(tmp_path, full_run):
    """On a tmpfs with room for one checkpoint and a half (a private mount: needs the right to mount one)."""
    out = tmp_path / "run"
    out.mkdir()
    if not _can_mount_tmpfs(out):
        pytest.skip("cannot mount a tmpfs here (unshare -m needs CAP_SYS_ADMIN)")
    full, _ = full_run("sft")
    size = sum(p.stat().st_size for p in (full / "checkpoints" / "step-1").rglob("*") if p.is_file()) * 3 // 2
    args = [*ARGS, "--max_steps", "4", "--save_steps", "1", "--save_total_limit", "1", "--output_dir", str(out),
            "--cache_dir", str(tmp_path / "cache")]  # fmt: skip
    # Inside the private mount: train, then list what the checkpoints folder holds (the mount ends with the shell).
    run = 'mount -t tmpfs -o size="$0" tmpfs "$1" || exit 99; out="$1"; shift; "$@"; code=$?; ls "$out/checkpoints"'
    run += "; exit $code"
    cmd = ["unshare", "-m", "sh", "-c", run, str(size), str(out), *launch_command("recipes/sft.py", args)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    errors = _errors(result)
    assert len(errors) == 1 and errors[0].startswith(
        f"tunebook: error: no space left on device: checkpoint {out}/checkpoints/step-2 needs "
    ), errors
    assert errors[0].endswith("the partial step-2.tmp was removed; earlier checkpoints are kept (newest: step-1)")
    assert result.stdout.splitlines()[-1:] == ["step-1"]  # nothing else: no step-2.tmp


@pytest.mark.parametrize("name", RECIPES)
def test_a_damaged_best_checkpoint_is_not_loaded_at_the_end(name, tmp_path, monkeypatch, capsys):
    """`load_best_model_at_end` verifies the best checkpoint first: damaged after it was saved, it is not loaded,
    and the final step's weights (those of the last checkpoint) are the run's model, with a warning."""
    from safetensors.torch import load_file

    import tunebook.training.manifest

    real = tunebook.training.manifest.verify_checkpoint

    def damage_then_verify(checkpoint, log):  # the best checkpoint's weights go bad just before they are loaded
        _truncate(Path(checkpoint) / "model.safetensors")
        return real(checkpoint, log)

    monkeypatch.setattr(tunebook.training.manifest, "verify_checkpoint", damage_then_verify)
    # The "best" is the worst here (the loss at its highest, GRPO's reward at its lowest): an early step, not the last.
    metric, greater = ("reward", False) if name == "grpo" else ("loss", True)
    summary = _run(name, tmp_path / "run", tmp_path / "cache", eval_steps=2, save_steps=2, save_total_limit=0,
                   load_best_model_at_end=True, metric_for_best_model=metric, greater_is_better=greater)  # fmt: skip
    best = summary["best"]["best_step"]
    assert best < 6  # else nothing would be loaded: the test would prove nothing
    log = capsys.readouterr().out
    warning = f"the best checkpoint {tmp_path}/run/checkpoints/step-{best} (step {best}) is damaged (size of model"
    assert f"load_best_model_at_end: {warning}" in log, log[-3000:]
    assert "Loaded the best checkpoint" not in log
    final = load_file(tmp_path / "run" / "checkpoints" / "step-6" / "model.safetensors")
    exported = load_file(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(exported[k], v) for k, v in final.items() if k in exported)
    assert summary["eval"] == _records_at(tmp_path / "run", 6)


def _records_at(out: Path, step: int) -> dict:
    """The evaluation logged at `step` (metrics.jsonl)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next({k: v for k, v in r.items() if k != "step"} for r in records if r["step"] == step and "loss" not in r)


def test_export_of_a_damaged_checkpoint_is_one_line(tmp_path, full_run):
    full, _ = full_run("sft")
    checkpoint = tmp_path / "step-7"
    shutil.copytree(full / "checkpoints" / "step-7", checkpoint)
    (checkpoint / "model.safetensors").unlink()
    tunebook = Path(sys.executable).parent / "tunebook"
    done = subprocess.run([tunebook, "export", str(checkpoint), str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        f"tunebook: error: {checkpoint} is damaged: missing file model.safetensors; export another checkpoint of "
        "the run"
    ]
