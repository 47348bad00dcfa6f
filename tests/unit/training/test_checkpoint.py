"""Checkpoint integrity: the manifest and what verifying against it finds, which checkpoint `resolve_checkpoint`
chooses when some are damaged, and a save that runs out of disk space (simulated: free space reported low, writers
that fail as torch, safetensors and the file system fail)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from tunebook.errors import ConfigError, TrainingError
from tunebook.training.checkpoint import list_checkpoints, resolve_checkpoint, save_checkpoint
from tunebook.training.manifest import MANIFEST, verify_checkpoint, write_manifest

LOG = logging.getLogger("tunebook")


def _checkpoint(root: Path, step: int) -> Path:
    """A checkpoint-shaped folder with a manifest: a few files of a few sizes, one in a subfolder."""
    path = root / "checkpoints" / f"step-{step}"
    (path / "tokenizer").mkdir(parents=True)
    (path / "model.safetensors").write_bytes(os.urandom(50_000))
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (path / "tokenizer" / "tokenizer.json").write_text("{}")
    write_manifest(path)
    return path


def _scramble(path: Path) -> None:
    """Other bytes, the same size: only a checksum can tell."""
    path.write_bytes(bytes(b ^ 0x5A for b in path.read_bytes()))


def test_the_manifest_lists_every_file_with_its_size_and_checksum(tmp_path):
    path = _checkpoint(tmp_path, 1)
    manifest = json.loads((path / MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["model.safetensors", "tokenizer/tokenizer.json", "trainer_state.json"]
    assert manifest["files"]["model.safetensors"]["size"] == 50_000
    assert manifest["total_bytes"] == sum(
        p.stat().st_size for p in path.rglob("*") if p.name != MANIFEST and p.is_file()
    )
    assert verify_checkpoint(path, LOG) is None


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda p: os.truncate(p / "model.safetensors", 20_000),
         "size of model.safetensors is 20000 bytes, the manifest says 50000"),
        (lambda p: (p / "model.safetensors").unlink(), "missing file model.safetensors"),
        (lambda p: _scramble(p / "trainer_state.json"), "checksum mismatch of trainer_state.json"),
        (lambda p: _scramble(p / "tokenizer" / "tokenizer.json"), "checksum mismatch of tokenizer/tokenizer.json"),
        (lambda p: (p / MANIFEST).write_text("{garbage"), "unreadable manifest.json (Expecting property name"),
        (lambda p: (p / MANIFEST).write_text('{"checksum": "xxh3_64", "files": {"../x": {"size": 1, "xxh3_64": ""}}}'),
         "unreadable manifest.json (a path outside the checkpoint)"),
    ],
)  # fmt: skip
def test_verifying_names_what_is_wrong(tmp_path, damage, problem):
    path = _checkpoint(tmp_path, 1)
    damage(path)
    assert verify_checkpoint(path, LOG).startswith(problem)


def test_a_checkpoint_without_a_manifest_is_accepted_unverified(tmp_path, caplog):
    path = _checkpoint(tmp_path, 1)
    (path / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="tunebook"):
        assert verify_checkpoint(path, LOG) is None
    assert "has no manifest.json (saved by an earlier Tunebook): its files are not verified" in caplog.text


def test_latest_and_auto_fall_back_to_the_newest_intact_checkpoint(tmp_path, caplog):
    for step in (1, 2, 3):
        _checkpoint(tmp_path, step)
    os.truncate(tmp_path / "checkpoints" / "step-3" / "model.safetensors", 10)
    _scramble(tmp_path / "checkpoints" / "step-2" / "trainer_state.json")
    with caplog.at_level(logging.WARNING, logger="tunebook"):
        assert resolve_checkpoint(tmp_path, "latest").name == "step-1"
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        f"Checkpoint {tmp_path}/checkpoints/step-3 is damaged (size of model.safetensors is 10 bytes, the manifest "
        "says 50000): resuming from step-1, the newest intact one; step-3 was renamed step-3.damaged",
        f"Checkpoint {tmp_path}/checkpoints/step-2 is damaged (checksum mismatch of trainer_state.json): resuming "
        "from step-1, the newest intact one; step-2 was renamed step-2.damaged",
    ]
    # Set aside, files kept: neither counts as the run's newest again, nor survives rotation in a new one's place.
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-1"]
    assert (tmp_path / "checkpoints" / "step-3.damaged" / "model.safetensors").stat().st_size == 10
    assert resolve_checkpoint(tmp_path, "auto").name == "step-1"


def test_no_intact_checkpoint_and_a_damaged_named_one_stop_with_one_line(tmp_path):
    for step in (1, 2):
        _checkpoint(tmp_path, step)
    (tmp_path / "checkpoints" / "step-2" / "model.safetensors").unlink()
    with pytest.raises(TrainingError, match=r"^resume_from_checkpoint: checkpoint .*step-2 is damaged: missing file "
                                            r"model.safetensors$"):  # fmt: skip
        resolve_checkpoint(tmp_path, str(tmp_path / "checkpoints" / "step-2"))
    os.truncate(tmp_path / "checkpoints" / "step-1" / "model.safetensors", 0)
    for spec in ("latest", "auto"):
        with pytest.raises(TrainingError) as error:
            resolve_checkpoint(tmp_path, spec)
        assert str(error.value) == (
            f"resume_from_checkpoint {spec}: no intact checkpoint in {tmp_path}/checkpoints: step-2: missing file "
            "model.safetensors; step-1: size of model.safetensors is 0 bytes, the manifest says 50000. Start over "
            "with --overwrite_output_dir true (deletes them)"
        )
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="is not found"):
        resolve_checkpoint(tmp_path, str(tmp_path / "nowhere"))


# --- a save without disk space


@pytest.fixture
def prepared():
    """An Accelerator with a model and AdamW after one step (its state exists), and a config to save."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from tunebook.config import SFTConfig, parse_config

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(64, 64)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    model(torch.ones(2, 64)).sum().backward()
    optimizer.step()
    yield accelerator, parse_config(SFTConfig)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def trained(prepared, tmp_path):
    """`save(step)` saves a checkpoint of `prepared`; the first, step-1, is saved."""

    def save(step):
        return save_checkpoint(*prepared[:1], tmp_path, step, prepared[1], {"epoch": 0}, keep=0)

    save(1)
    return save


Usage = namedtuple("Usage", "total used free")


def _disk(monkeypatch, free=None):
    """Report `free` bytes free (None: the real figure) wherever a save asks, until `free` is changed."""
    real, state = shutil.disk_usage, {"free": free}

    def disk_usage(path):
        usage = real(path)
        return usage if state["free"] is None else Usage(usage.total, usage.total - state["free"], state["free"])

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    return state


def _fail_writing(monkeypatch, target, name, error, disk=None):
    """`target.name` raises `error` (after reporting the disk full, with `disk`), as a writer meeting a full disk."""

    def fail(*args, **kwargs):
        if disk is not None:
            disk["free"] = 0
        raise error

    monkeypatch.setattr(target, name, fail)


def _torch_save(monkeypatch, disk):
    # What torch.save raises on a full disk: the stream's error, without errno.
    _fail_writing(monkeypatch, torch, "save", RuntimeError("basic_ios::clear: iostream error"), disk)


def _safetensors(monkeypatch, disk):
    import accelerate.utils.other
    from safetensors import SafetensorError

    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    _fail_writing(monkeypatch, accelerate.utils.other, "safe_save_file", full)


def _enospc_on_main(monkeypatch, disk):
    import tunebook.training.checkpoint

    full = OSError(errno.ENOSPC, "No space left on device")
    _fail_writing(monkeypatch, tunebook.training.checkpoint, "write_manifest", full)


def _too_little_free(monkeypatch, disk):
    disk["free"] = 1000  # the previous checkpoint's size is known (its manifest): nothing is written


@pytest.mark.parametrize("fault", [_too_little_free, _torch_save, _safetensors, _enospc_on_main])
def test_a_save_without_space_stops_with_one_line_and_keeps_the_earlier_checkpoint(trained, tmp_path, monkeypatch,
                                                                                  fault):  # fmt: skip
    size = json.loads((tmp_path / "checkpoints" / "step-1" / MANIFEST).read_text())["total_bytes"]
    disk = _disk(monkeypatch)
    fault(monkeypatch, disk)
    with pytest.raises(TrainingError) as error:
        trained(2)
    free = 1000 if fault is _too_little_free else 0 if fault is _torch_save else shutil.disk_usage(tmp_path).free
    line = str(error.value)
    assert line.startswith(
        f"no space left on device: checkpoint {tmp_path}/checkpoints/step-2 needs {size} bytes "
        f"({size / 1024:.1f} KiB), {free} bytes"
    ), line
    assert line.endswith(" free; the partial step-2.tmp was removed; earlier checkpoints are kept (newest: step-1)")
    assert "\n" not in line
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]
    assert verify_checkpoint(tmp_path / "checkpoints" / "step-1", LOG) is None


def test_the_first_save_is_checked_against_the_trained_weights_and_their_optimizer_state(prepared, tmp_path,
                                                                                          monkeypatch):  # fmt: skip
    needed = 3 * 4 * (64 * 64 + 64) + 2 * 4  # weights, exp_avg, exp_avg_sq in float32, and the 2 tensors' steps
    _disk(monkeypatch, free=needed - 1)
    with pytest.raises(TrainingError, match=rf"^no space left on device: checkpoint .*step-1 needs {needed} bytes"):
        save_checkpoint(prepared[0], tmp_path, 1, prepared[1], {}, keep=0)
    assert not (tmp_path / "checkpoints" / "step-1.tmp").exists()


def test_a_write_error_that_is_not_the_disk_is_not_called_one(trained, tmp_path, monkeypatch):
    import tunebook.training.checkpoint

    # Plenty of space: torch's stream error is then something else, raised as it is (a bug keeps its traceback).
    _fail_writing(monkeypatch, torch, "save", RuntimeError("basic_ios::clear: iostream error"))
    with pytest.raises(RuntimeError, match="basic_ios"):
        trained(2)
    monkeypatch.undo()
    # A file-system error is the environment's: one line, naming the checkpoint.
    _fail_writing(
        monkeypatch, tunebook.training.checkpoint, "write_manifest", PermissionError(errno.EACCES, "Permission denied")
    )
    with pytest.raises(
        TrainingError, match=r"^could not save checkpoint .*step-3: PermissionError: \[Errno 13\] Perm"
    ):
        trained(3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]
