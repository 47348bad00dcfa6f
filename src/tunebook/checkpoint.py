"""Checkpoints and the final model: written atomically, by the main process where files are shared.

A checkpoint is `output_dir/checkpoints/step-<N>/`: Accelerate's `save_state` (model as safetensors, optimizer,
scheduler, gradient scaler, every process's RNG state), plus `trainer_state.json` (step, data position, counters,
the recipe), the resolved `config.yaml`, the tokenizer and the model's own `config.json` (in `model_config/`). It
is written into `step-<N>.tmp` and renamed into place only when every process has written its part and the files
are flushed, so a crash or `kill -9` during a save leaves the previous checkpoint as the newest complete one and
never a `step-<N>` that is not whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from .config import save_config
from .errors import ConfigError
from .models.wrappers import unwrap

__all__ = [
    "TRAINER_STATE",
    "checkpoint_path",
    "list_checkpoints",
    "load_process_state",
    "load_trainer_state",
    "resolve_checkpoint",
    "save_checkpoint",
    "save_final_model",
]

STEP_DIR = re.compile(r"^step-(\d+)$")
TRAINER_STATE = "trainer_state.json"
MODEL_CONFIG_DIR = "model_config"  # the model's config.json (and generation_config.json), inside a checkpoint


def checkpoint_path(output_dir: str | Path, step: int) -> Path:
    """Where `save_checkpoint` puts the checkpoint of optimizer step `step`."""
    return Path(output_dir) / "checkpoints" / f"step-{step}"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders of interrupted saves are not listed)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if (p / TRAINER_STATE).is_file()]


def resolve_checkpoint(output_dir: str | Path, spec: str) -> Path | None:
    """`latest`: the newest complete checkpoint of `output_dir` (an error if there is none); `auto`: the same, or
    None when there is none yet; else the path of a checkpoint."""
    if spec in ("latest", "auto"):
        found = list_checkpoints(output_dir)
        if not found and spec == "latest":
            raise ConfigError(
                f"resume_from_checkpoint latest: no checkpoint in {Path(output_dir) / 'checkpoints'} (is output_dir "
                "right? resume_from_checkpoint auto starts from scratch when there is none)"
            )
        return found[-1] if found else None
    path = Path(spec).expanduser()
    if not (path / TRAINER_STATE).is_file():
        what = "not found" if not path.exists() else f"not a complete checkpoint (no {TRAINER_STATE})"
        raise ConfigError(f"resume_from_checkpoint: {spec} is {what}")
    return path


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
) -> Path:
    """`accelerator.save_state` into `checkpoints/step-<step>.tmp`, then rename it into place.

    Call it at an optimizer-step boundary on every process. `state` is shared (written by the main process),
    `process_state` is this process's own (each writes `process_state_<rank>.json`, as Accelerate writes each
    rank's RNG state). The rename happens only after every process has written its part (barrier) and the files
    are flushed. `keep` > 0 deletes all but the newest `keep`, and never `protect` (the best checkpoint).
    The trainer state and config.yaml also name the `recipe`, and `model_config/` holds the prepared
    model's Hugging Face config, so `export_checkpoint` rebuilds the model from the checkpoint alone.
    """
    final = checkpoint_path(output_dir, step)
    root, tmp = final.parent, final.with_name(f"{final.name}.tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    if process_state is not None:
        path = tmp / f"process_state_{accelerator.process_index}.json"
        path.write_text(json.dumps(process_state))
    # Without this barrier another rank could still be writing its RNG state when the main process renames.
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_config(config, tmp / "config.yaml", recipe)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "tokenizer")
        _save_model_config(accelerator, tmp / MODEL_CONFIG_DIR)
        shared = {"global_step": step, "recipe": recipe, **state}
        (tmp / TRAINER_STATE).write_text(json.dumps(shared, indent=2))
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        _fsync_dir(root)
        if keep > 0:
            kept = Path(protect).resolve() if protect else None
            for old in list_checkpoints(output_dir)[:-keep]:
                if old.resolve() != kept:
                    shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _save_model_config(accelerator: Accelerator, directory: Path) -> None:
    """The prepared model's `config.json` (and `generation_config.json`) into `directory`: its architecture with the
    label set and the embedding size after any resize. Of a LoRA model, its base model's; a model without a Hugging
    Face config (a plain `torch.nn.Module`) writes nothing. Config files only: no weights are gathered."""
    from .models.lora import is_peft_model

    if not accelerator._models:
        return
    model = unwrap(accelerator._models[0])
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
    model is saved as its adapter directory instead, and with `merge_adapter` also merged (`models.save_adapter`).
    """
    from .models.lora import is_peft_model, save_adapter

    if is_peft_model(unwrap(model)):
        save_adapter(accelerator, model, tokenizer, output_dir, merge=merge_adapter)
        return
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = unwrap(model)
        unwrapped.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(output_dir)
    accelerator.wait_for_everyone()
