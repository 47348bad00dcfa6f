"""Checkpoints and the final model: written atomically, by the main process where files are shared.

A checkpoint is `output_dir/checkpoints/step-<N>/`: Accelerate's `save_state` (model as safetensors, optimizer,
scheduler, gradient scaler, every process's RNG state), plus `trainer_state.json` (step, data position, counters,
the recipe), the resolved `config.yaml`, the tokenizer and the model's own `config.json` (in `model_config/`). It
is written into `step-<N>.tmp` and renamed into place only when every process has written its part and the files
are flushed, so a crash or `kill -9` during a save leaves the previous checkpoint as the newest complete one and
never a `step-<N>` that is not whole. Its last file is `manifest.json` (every file's size and checksum,
`tunebook.training.manifest`): `resolve_checkpoint` verifies a checkpoint against it before it is resumed, and `latest` falls
back to the newest intact one. A save the disk has no room for stops the run with one line, on every process, and
leaves no partial folder behind; the checkpoints before it stay as they were.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from .. import compat
from ..config import save_config
from ..distributed import decided_by_main
from ..errors import ConfigError, TrainingError, first_line, same_on_every_rank
from ..locations import TRAINER_STATE, list_checkpoints
from ..models.tokenizer import save_tokenizer
from ..models.wrappers import unwrap
from .manifest import MANIFEST, manifest_bytes, verify_checkpoint, write_manifest

__all__ = [
    "TRAINER_STATE",
    "checkpoint_path",
    "list_checkpoints",
    "load_process_state",
    "load_trainer_state",
    "resolve_checkpoint",
    "save_checkpoint",
    "save_adapter",
    "save_final_model",
]

logger = logging.getLogger("tunebook")

MODEL_CONFIG_DIR = "model_config"  # the model's config.json (and generation_config.json), inside a checkpoint
SCHEDULE = "lr_scheduler.json"  # the learning-rate schedule's state where Accelerate's save_state leaves it out
DAMAGED = ".damaged"  # suffix of a damaged checkpoint set aside by `resolve_checkpoint`


def checkpoint_path(output_dir: str | Path, step: int) -> Path:
    """Where `save_checkpoint` puts the checkpoint of optimizer step `step`."""
    return Path(output_dir) / "checkpoints" / f"step-{step}"


def resolve_checkpoint(output_dir: str | Path, spec: str, log: logging.Logger = logger) -> Path | None:
    """`latest`: the newest intact checkpoint of `output_dir` (an error if there is none); `auto`: the same, or None
    when there is no checkpoint yet; else the path of a checkpoint, which must be intact.

    Each is verified against its manifest. `latest` and `auto` pass over damaged checkpoints to the newest intact
    one, with a warning naming each and what is wrong, and set the damaged ones aside as `step-<N>.damaged`: the
    resumed run saves those steps again, and rotation must not keep a damaged folder in place of a new checkpoint.
    A damaged checkpoint named by its path stops the run. Call it on one process (`decided_by_main`)."""
    if spec in ("latest", "auto"):
        found = list_checkpoints(output_dir)
        if not found and spec == "latest":
            raise ConfigError(
                f"resume_from_checkpoint latest: no checkpoint in {Path(output_dir) / 'checkpoints'} (is output_dir "
                "right? resume_from_checkpoint auto starts from scratch when there is none)"
            )
        damaged = []
        for path in reversed(found):
            problem = verify_checkpoint(path, log)
            if problem is None:
                _set_aside(damaged, path, log)
                return path
            damaged.append((path, problem))
        if damaged:
            raise TrainingError(
                f"resume_from_checkpoint {spec}: no intact checkpoint in {Path(output_dir) / 'checkpoints'}: "
                + "; ".join(f"{path.name}: {problem}" for path, problem in damaged)
                + ". Start over with --overwrite_output_dir true (deletes them)"
            )
        return None
    path = Path(spec).expanduser()
    if not ((path / TRAINER_STATE).is_file() or (path / MANIFEST).is_file()):
        what = "not found" if not path.exists() else f"not a complete checkpoint (no {TRAINER_STATE})"
        raise ConfigError(f"resume_from_checkpoint: {spec} is {what}")
    if problem := verify_checkpoint(path, log):
        raise TrainingError(f"resume_from_checkpoint: checkpoint {path} is damaged: {problem}")
    return path


def _set_aside(damaged: list[tuple[Path, str]], intact: Path, log: logging.Logger) -> None:
    for path, problem in damaged:
        aside = path.with_name(path.name + DAMAGED)
        shutil.rmtree(aside, ignore_errors=True)
        path.rename(aside)
        log.warning("Checkpoint %s is damaged (%s): resuming from %s, the newest intact one; %s was renamed %s",
                    path, problem, intact.name, path.name, aside.name)  # fmt: skip


def load_trainer_state(checkpoint: str | Path) -> dict[str, Any]:
    """The shared state: step, data position, best metric... (written by the main process)."""
    return json.loads((Path(checkpoint) / TRAINER_STATE).read_text())


def load_process_state(checkpoint: str | Path, process_index: int) -> dict[str, Any]:
    """What this process saved of its own (running sums), as `save_checkpoint(process_state=...)` wrote it."""
    return json.loads((Path(checkpoint) / f"process_state_{process_index}.json").read_text())


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: str | Path,
    step: int,
    config: Any,
    state: dict[str, Any],
    keep: int,
    tokenizer=None,
    process_state: dict[str, Any] | None = None,
    protect: str | Path | None = None,
    recipe: str | None = None,
    schedule: dict[str, Any] | None = None,
) -> Path:
    """`accelerator.save_state` into `checkpoints/step-<step>.tmp`, then rename it into place.

    Call it at an optimizer-step boundary on every process. `state` is shared (written by the main process),
    `process_state` is this process's own (each writes `process_state_<rank>.json`, as Accelerate writes each
    rank's RNG state). The rename happens only after every process has written its part, the manifest is written
    and the files are flushed. `keep` > 0 deletes all but the newest `keep`, and never `protect` (the best one).
    The trainer state and config.yaml also name the `recipe`, and `model_config/` holds the prepared
    model's Hugging Face config, so `export_checkpoint` rebuilds the model from the checkpoint alone. `schedule` is
    the learning-rate schedule's state where Accelerate leaves it out (`schedule_state`), written as JSON.

    A save that finds too little free space for the previous checkpoint's size (or, for the first, for the trained
    weights and their optimizer state), or whose writes fail for lack of space, raises a `TrainingError` saying so
    on every process, after removing `step-<step>.tmp`; so does any other write error, once every process knows.
    """
    final = checkpoint_path(output_dir, step)
    tmp = final.with_name(f"{final.name}.tmp")
    main = accelerator.is_main_process
    needed = _expected_bytes(accelerator, output_dir) if main else 0
    # Each phase ends with every process learning whether any failed (instead of a barrier a failed one never
    # reaches), so all stop alike and none is left waiting.
    _agree(accelerator, _attempt(_start_save, tmp, needed) if main else None, final, needed)
    _agree(accelerator, _attempt(_save_process_parts, accelerator, tmp, process_state), final, needed)
    shared = {"global_step": step, "recipe": recipe, **state}
    parts = (accelerator, tmp, final, config, recipe, tokenizer, shared, schedule)
    _agree(accelerator, _attempt(_complete_save, *parts) if main else None, final, needed)
    if main and keep > 0:
        kept = Path(protect).resolve() if protect else None
        for old in list_checkpoints(output_dir)[:-keep]:
            if old.resolve() != kept:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _start_save(tmp: Path, needed: int) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(tmp.parent).free
    if free < needed:  # found before a byte is written: the disk is not filled up for nothing
        raise OSError(errno.ENOSPC, f"{free} bytes free, {needed} needed")
    tmp.mkdir()


def _save_process_parts(accelerator: Accelerator, tmp: Path, process_state: dict[str, Any] | None) -> None:
    hook = accelerator.register_save_state_pre_hook(_drop_tied_copies)
    try:
        accelerator.save_state(str(tmp), safe_serialization=True)
    finally:
        hook.remove()
    if process_state is not None:
        (tmp / f"process_state_{accelerator.process_index}.json").write_text(json.dumps(process_state))


def _drop_tied_copies(models: list, weights: list[dict[str, Any]], output_dir: str) -> None:
    """Tied weights (embeddings and LM head) are one tensor under two names, which safetensors stores once: keep the
    first name, as Accelerate would when it writes the file, so it does not warn "Removed shared tensor" at every
    checkpoint. The file is the same; loading ties the weights again."""
    import collections

    from accelerate.utils import id_tensor_storage

    for state_dict in weights:
        names = collections.defaultdict(list)
        for name, tensor in state_dict.items():
            if not isinstance(tensor, str):  # bitsandbytes' serialized entries
                names[id_tensor_storage(tensor)].append(name)
        for shared in names.values():
            for name in shared[1:]:
                del state_dict[name]


def _complete_save(accelerator, tmp: Path, final: Path, config, recipe, tokenizer, shared, schedule) -> None:
    """The main process's part, once every process has written its own: the shared files, the manifest, the
    rename."""
    save_config(config, tmp / "config.yaml", recipe)
    if tokenizer is not None:
        save_tokenizer(tokenizer, tmp / "tokenizer")
    _save_model_config(accelerator, tmp / MODEL_CONFIG_DIR)
    if schedule is not None:
        (tmp / SCHEDULE).write_text(json.dumps(schedule))
    (tmp / TRAINER_STATE).write_text(json.dumps(shared, indent=2))
    write_manifest(tmp)  # last: a checkpoint with a manifest is one whose every file was written
    _fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(final.parent)


def _attempt(write: Callable[..., None], *args) -> Exception | None:
    """Run one phase of a save; return what it raised (a kill or Ctrl-C is not caught: nothing more is written)."""
    try:
        write(*args)
    except Exception as error:
        return error
    return None


def _agree(accelerator: Accelerator, error: Exception | None, final: Path, needed: int) -> None:
    """Every process learns whether any failed its part of the save; if one did, the main process removes the
    partial folder and every process raises the same line (a process whose own failure is not the disk's or the
    file system's raises that error itself, traceback and all)."""
    tmp = final.with_name(f"{final.name}.tmp")
    kind = None if error is None else _failure_kind(error, tmp, needed)
    failures = [(accelerator.process_index, kind, f"{type(error).__name__}: {first_line(error)}")] if kind else []
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        failures = gather_object(failures)
    if not failures:
        return
    message = None
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        message = _failure_message(failures, final, needed, accelerator.num_processes)
    message = decided_by_main(accelerator, lambda: message)
    if kind == "other":
        raise error
    raise same_on_every_rank(TrainingError(message))


def _failure_kind(error: Exception, tmp: Path, needed: int) -> str:
    """'disk' when the disk ran out of space, 'os' for another file-system error, 'other' for anything else."""
    text = str(error)
    if (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
        s in text for s in ("No space left on device", "Disk quota exceeded", "os error 28)", "os error 122)")
    ):
        return "disk"
    if isinstance(error, RuntimeError) and _too_full(tmp, needed):
        # torch.save reports a failed write without its cause ("basic_ios::clear: iostream error", "unexpected pos
        # 704 vs 598"): it was the disk if what is left there cannot hold the rest of the checkpoint.
        return "disk"
    return "os" if isinstance(error, OSError) else "other"


def _too_full(tmp: Path, needed: int) -> bool:
    try:
        written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        return shutil.disk_usage(tmp.parent).free < max(needed - written, 1 << 20)
    except OSError:
        return False


def _failure_message(failures: list[tuple[int, str, str]], final: Path, needed: int, processes: int) -> str:
    rank, kind, detail = next((f for f in failures if f[1] == "disk"), failures[0])
    where = f" (process {rank})" if processes > 1 else ""
    kept = [p.name for p in list_checkpoints(final.parent.parent)] or ["none"]
    after = f"the partial {final.name}.tmp was removed; earlier checkpoints are kept (newest: {kept[-1]})"
    if kind == "disk":
        free = shutil.disk_usage(final.parent).free
        return f"no space left on device{where}: checkpoint {final} needs {_size(needed)}, {_size(free)} free; {after}"
    return f"could not save checkpoint {final}{where}: {detail}; {after}"


def _expected_bytes(accelerator: Accelerator, output_dir: str | Path) -> int:
    """What the next checkpoint will take: the previous one's size (from its manifest), or, for the first, a lower
    bound that is cheap to know: the weights the optimizer trains and its state, of this process."""
    import torch

    found = list_checkpoints(output_dir)
    if found and (previous := manifest_bytes(found[-1])) is not None:
        return previous
    total = 0
    for optimizer in compat.prepared_optimizers(accelerator):
        inner = getattr(optimizer, "optimizer", optimizer)
        tensors = [p for group in inner.param_groups for p in group["params"]]
        tensors += [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t)]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def _size(n: int) -> str:
    """`54620160 bytes (52.1 MiB)`: exact, and readable."""
    scaled, unit = float(n), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if scaled < 1024 or unit == "TiB":
            break
        scaled /= 1024
    return f"{n} bytes" if unit == "bytes" else f"{n} bytes ({scaled:.1f} {unit})"


def _save_model_config(accelerator: Accelerator, directory: Path) -> None:
    """The prepared model's `config.json` (and `generation_config.json`) into `directory`: its architecture with the
    label set and the embedding size after any resize. Of a LoRA model, its base model's; a model without a Hugging
    Face config (a plain `torch.nn.Module`) writes nothing. Config files only: no weights are gathered."""
    from ..models.lora import is_peft_model

    if not compat.prepared_models(accelerator):
        return
    model = unwrap(compat.prepared_models(accelerator)[0])
    if is_peft_model(model):
        model = model.get_base_model()
    if not hasattr(getattr(model, "config", None), "save_pretrained"):
        return
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for path in [directory, *(p for p in directory.rglob("*") if p.is_dir())]:
        _fsync_dir(path)


def _fsync_dir(directory: Path) -> None:
    """Make a rename or new entries in `directory` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_final_model(accelerator: Accelerator, model, tokenizer, output_dir: str | Path, merge_adapter=False) -> None:
    """Save a Hugging Face model directory (safetensors) and tokenizer that `from_pretrained` loads.

    `get_state_dict` gathers sharded states (FSDP, ZeRO-3) on every process; only the main process writes. A LoRA
    model is saved as its adapter directory instead, and with `merge_adapter` also merged (`save_adapter`).
    A disk without room for it stops the run with one line on every process, naming the checkpoint to export the
    model from once there is room (the run's checkpoints are not touched).
    """
    from ..models.lora import is_peft_model

    if is_peft_model(unwrap(model)):
        save_adapter(accelerator, model, tokenizer, output_dir, merge=merge_adapter)
        return
    state_dict = accelerator.get_state_dict(model)

    def write() -> None:
        needed = sum(t.numel() * t.element_size() for t in state_dict.values())
        with final_save(output_dir, needed):
            unwrap(model).save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
            save_tokenizer(tokenizer, output_dir)

    decided_by_main(accelerator, write)  # the main process writes; every process learns how that went


def save_adapter(accelerator, model, tokenizer, output_dir: str | Path, merge: bool = False) -> Path:
    """Write the adapter directory (adapters, `adapter_config.json`, tokenizer) into `output_dir`; with `merge`,
    also the merged model into `output_dir/merged`. Call on every process (sharded states are gathered)."""
    from ..models.lora import adapter_writer

    write_files, needed = adapter_writer(accelerator, model, tokenizer, output_dir, merge)

    def write() -> None:
        with final_save(output_dir, needed):
            write_files()

    decided_by_main(accelerator, write)  # the main process writes; every process learns how that went
    return Path(output_dir)


@contextmanager
def final_save(output_dir: str | Path, needed: int):
    """Around the writes of the final model into `output_dir`: a write that fails for lack of space (`needed` bytes
    being what it takes) is one `TrainingError` line instead of safetensors' or torch's traceback; any other
    failure is raised as it is."""
    output_dir = Path(output_dir)
    try:
        yield
    except Exception as error:
        if _failure_kind(error, output_dir / "checkpoints", needed) != "disk":
            raise
        found = list_checkpoints(output_dir)
        then = (f"free some space, then write it from the last checkpoint: tunebook export {found[-1]} {output_dir}"
                if found else "no checkpoint was saved (save_steps), so the trained weights are lost: free some "
                "space and train again")  # fmt: skip
        free = shutil.disk_usage(output_dir).free
        raise TrainingError(
            f"no space left on device: the final model in {output_dir} needs {_size(needed)}, {_size(free)} free; "
            f"{then}"
        ) from None
