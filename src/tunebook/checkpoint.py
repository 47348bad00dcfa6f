"""Checkpoints and the final model: written atomically, by the main process where files are shared.

A checkpoint is `output_dir/checkpoints/step-<N>/`: Accelerate's `save_state` (model as safetensors, optimizer,
scheduler, gradient scaler, every process's RNG state), plus `trainer_state.json` (step, data position, counters),
the resolved `config.yaml` and the tokenizer. It is written into `step-<N>.tmp` and renamed into place only when
every process has written its part and the files are flushed, so a crash or `kill -9` during a save leaves the
previous checkpoint as the newest complete one and never a `step-<N>` that is not whole.
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

__all__ = [
    "TRAINER_STATE",
    "checkpoint_path",
    "export_checkpoint",
    "list_checkpoints",
    "load_process_state",
    "load_trainer_state",
    "resolve_checkpoint",
    "resume_training",
    "save_checkpoint",
    "save_training_state",
    "save_final_model",
]

STEP_DIR = re.compile(r"^step-(\d+)$")
TRAINER_STATE = "trainer_state.json"


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
    """`latest`: the newest complete checkpoint of `output_dir` (None if there is none yet); else a path to one."""
    if spec == "latest":
        found = list_checkpoints(output_dir)
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
) -> Path:
    """`accelerator.save_state` into `checkpoints/step-<step>.tmp`, then rename it into place.

    Call it at an optimizer-step boundary on every process. `state` is shared (written by the main process),
    `process_state` is this process's own (each writes `process_state_<rank>.json`, as Accelerate writes each
    rank's RNG state). The rename happens only after every process has written its part (barrier) and the files
    are flushed. `keep` > 0 deletes all but the newest `keep`, and never `protect` (the best checkpoint).
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
        save_config(config, tmp / "config.yaml")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "tokenizer")
        (tmp / TRAINER_STATE).write_text(json.dumps({"global_step": step, **state}, indent=2))
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


def save_training_state(
    accelerator: Accelerator, output_dir, step: int, config, state: dict[str, Any], tokenizer, counters, best
) -> Path:
    """A recipe's checkpoint at optimizer step `step`: `state` (epoch, data position...), this process's
    `counters` (`TrainCounters`) and the `best` model tracker (`BestModel` or None), whose checkpoint, if this is
    it, is recorded and protected from rotation."""
    if best is not None and best.best_step == step:
        best.best_checkpoint = str(checkpoint_path(output_dir, step))
    shared = {**state, "best": best.state_dict() if best is not None else None}
    return save_checkpoint(
        accelerator, output_dir, step, config, shared, config.save_total_limit, tokenizer, counters.state_dict(),
        best.best_checkpoint if best is not None else None,
    )  # fmt: skip


def resume_training(accelerator: Accelerator, output_dir, spec: str | None, counters, best):
    """Continue from checkpoint `spec` ('latest', a path, or None for a fresh start).

    Restores what `accelerator.save_state` saved (model, optimizer, scheduler, RNG states), this process's
    `counters` and the `best` tracker. Returns (checkpoint or None, trainer state with global_step, epoch and
    batches_in_epoch).
    """
    checkpoint = resolve_checkpoint(output_dir, spec) if spec else None
    if checkpoint is None:
        return None, {"global_step": 0, "epoch": 0, "batches_in_epoch": 0}
    accelerator.load_state(str(checkpoint))
    state = load_trainer_state(checkpoint)
    counters.load_state_dict(load_process_state(checkpoint, accelerator.process_index))
    if best is not None and state.get("best"):
        best.load_state_dict(state["best"])
    return checkpoint, state


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

    if is_peft_model(accelerator.unwrap_model(model)):
        save_adapter(accelerator, model, tokenizer, output_dir, merge=merge_adapter)
        return
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(output_dir)
    accelerator.wait_for_everyone()


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, merge: bool = False) -> Path:
    """Write a Hugging Face model directory (safetensors + tokenizer) from a training checkpoint.

    A LoRA checkpoint gives its adapter directory (with the tokenizer), or with `merge` the adapters folded into
    the base model as a plain model directory.

    The architecture comes from the checkpoint's `config.yaml` (a fresh model of the same config, no pretrained
    weights loaded), the weights from the checkpoint: Accelerate's `model.safetensors`, or the sharded state of an
    FSDP run merged first. Works for checkpoints of any number of processes: the model is saved whole.
    """
    import tempfile

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from .config import parse_config
    from .errors import ModelError
    from .models import TINY_LLAMA, build_causal_lm
    from .recipe_configs import SFTConfig

    checkpoint = Path(checkpoint)
    if not (checkpoint / TRAINER_STATE).is_file():
        raise ConfigError(f"{checkpoint} is not a complete Tunebook checkpoint (no {TRAINER_STATE})")
    if (checkpoint / "adapter").is_dir():
        from .models.lora import merge_adapter_dir

        out_dir = Path(out_dir)
        if merge:
            merge_adapter_dir(checkpoint / "adapter", out_dir)
        else:
            shutil.copytree(checkpoint / "adapter", out_dir, dirs_exist_ok=True)
        AutoTokenizer.from_pretrained(checkpoint / "tokenizer").save_pretrained(out_dir)
        return out_dir
    if merge:
        raise ConfigError(f"--merge: {checkpoint} is not a LoRA checkpoint (no adapter/), its model is whole already")
    config = parse_config(SFTConfig, config_file=checkpoint / "config.yaml")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint / "tokenizer")
    # Same architecture as training, built from the config: a pretrained model's own config.json, or model_config.
    model_config = config.model_name_or_path or config.model_config or TINY_LLAMA
    model = build_causal_lm(tokenizer, model_config=model_config, attn_implementation=config.attn_implementation)
    with tempfile.TemporaryDirectory() as tmp:
        weights = checkpoint / "model.safetensors"
        if not weights.is_file() and (checkpoint / "pytorch_model_fsdp_0").is_dir():
            from accelerate.utils import merge_fsdp_weights

            merge_fsdp_weights(str(checkpoint / "pytorch_model_fsdp_0"), tmp, safe_serialization=True)
            weights = Path(tmp) / "model.safetensors"
        if not weights.is_file():
            raise ModelError(f"{checkpoint}: no model weights found (model.safetensors or pytorch_model_fsdp_0/)")
        missing, unexpected = model.load_state_dict(load_file(weights), strict=False)
    tied = {name for name, p in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    if unexpected or set(missing) - tied:
        raise ModelError(
            f"{checkpoint}: weights do not fit the configured model (missing {missing}, unexpected {unexpected})"
        )
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
