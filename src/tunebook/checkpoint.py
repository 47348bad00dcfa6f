"""Checkpoints and the final model: written atomically, by the main process where files are shared."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from .config import save_config

__all__ = ["list_checkpoints", "save_checkpoint", "save_final_model"]

STEP_DIR = re.compile(r"^step-(\d+)$")


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders of interrupted saves are not listed)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def save_checkpoint(
    accelerator: Accelerator, output_dir: str | Path, step: int, config: Any, state: dict[str, Any], keep: int
) -> Path:
    """`accelerator.save_state` into `checkpoints/step-<step>.tmp`, then rename it into place.

    The rename happens only after every process has written its part (barrier), so a crash during the save
    leaves the previous checkpoint as the newest complete one. `keep` > 0 deletes all but the newest `keep`.
    """
    root = Path(output_dir) / "checkpoints"
    final, tmp = root / f"step-{step}", root / f"step-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        save_config(config, tmp / "config.yaml")
        (tmp / "trainer_state.json").write_text(json.dumps({"global_step": step, **state}, indent=2))
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        if keep > 0:
            for old in list_checkpoints(output_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def save_final_model(accelerator: Accelerator, model, tokenizer, output_dir: str | Path) -> None:
    """Save a Hugging Face model directory (safetensors) and tokenizer that `from_pretrained` loads.

    `get_state_dict` gathers sharded states (FSDP, ZeRO-3) on every process; only the main process writes.
    """
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(output_dir)
    accelerator.wait_for_everyone()
