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
from .errors import ConfigError, ModelError, first_line
from .recipe import recipe_name

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
    The trainer state also names the recipe of `config` (`recipe_name`), and `model_config/` holds the prepared
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
        save_config(config, tmp / "config.yaml")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "tokenizer")
        _save_model_config(accelerator, tmp / MODEL_CONFIG_DIR)
        shared = {"global_step": step, "recipe": recipe_name(config), **state}
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
    model = accelerator.unwrap_model(accelerator._models[0])
    if is_peft_model(model):
        model = model.get_base_model()
    if not hasattr(getattr(model, "config", None), "save_pretrained"):
        return
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)


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
    """Write a Hugging Face model directory (safetensors + tokenizer) from a checkpoint of any recipe.

    The model is rebuilt from the checkpoint alone (no Hub, no data): its recorded architecture (`model_config/`),
    a causal LM for sft, pretrain and dpo, a sequence classifier with the run's labels for classify, with the
    weights from the checkpoint: Accelerate's `model.safetensors`, or the sharded state of an FSDP run merged first
    (checkpoints of any number of processes). A checkpoint written before checkpoints held `model_config/` is
    rebuilt from its `config.yaml` (the recipe told by which recipe's config it is, when the trainer state does
    not name it). A LoRA checkpoint gives its adapter directory (with the tokenizer), or with `merge` the adapters
    folded into the base model as a plain model directory.

    Args:
        checkpoint: a checkpoint folder, `output_dir/checkpoints/step-<N>`.
        out_dir: the model directory to write (`from_pretrained` loads it).
        merge: for a LoRA checkpoint, write the merged model instead of the adapters.
    """
    from transformers import AutoTokenizer

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not (checkpoint / TRAINER_STATE).is_file():
        raise ConfigError(f"{checkpoint} is not a complete Tunebook checkpoint (no {TRAINER_STATE})")
    recipe = _checkpoint_recipe(checkpoint)
    if (checkpoint / "adapter").is_dir():
        from .models.lora import merge_adapter_dir

        if merge:  # the adapter's config names its base model; a classifier's head is among its saved modules
            merge_adapter_dir(checkpoint / "adapter", out_dir)
        else:
            shutil.copytree(checkpoint / "adapter", out_dir, dirs_exist_ok=True)
        AutoTokenizer.from_pretrained(checkpoint / "tokenizer").save_pretrained(out_dir)
        return out_dir
    if merge:
        raise ConfigError(f"--merge: {checkpoint} is not a LoRA checkpoint (no adapter/), its model is whole already")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint / "tokenizer")
    model = _rebuild_model(checkpoint, recipe, tokenizer)
    _load_checkpoint_weights(model, checkpoint)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _checkpoint_recipe(checkpoint: Path) -> str | None:
    """The recipe that wrote `checkpoint`, as its trainer state names it; for a checkpoint from before it did (or of
    a recipe of one's own), the first recipe whose config class has every key of its `config.yaml`, or None."""
    import dataclasses

    import yaml

    from .recipe import RECIPES, recipe_config_class

    recipe = load_trainer_state(checkpoint).get("recipe")
    if recipe:
        if recipe not in RECIPES:
            raise ConfigError(
                f"{checkpoint / TRAINER_STATE}: unknown recipe {recipe!r} (export knows {', '.join(RECIPES)})"
            )
        return recipe
    try:
        keys = set(yaml.safe_load((checkpoint / "config.yaml").read_text()) or {})
    except (OSError, yaml.YAMLError, TypeError):
        return None
    for name in RECIPES:
        if keys <= {f.name for f in dataclasses.fields(recipe_config_class(name))}:
            return name
    return None


def _rebuild_model(checkpoint: Path, recipe: str | None, tokenizer):
    """A fresh model (random weights) of the checkpoint's architecture: from `model_config/`, or for an older
    checkpoint from its `config.yaml` as the recipe built it (sft's head when the recipe is unknown)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    model_dir = checkpoint / MODEL_CONFIG_DIR
    if (model_dir / "config.json").is_file():
        config = AutoConfig.from_pretrained(model_dir)
        heads = config.architectures or []
        classify = recipe == "classify" or (
            recipe is None and any(a.endswith("SequenceClassification") for a in heads)
        )
        model = (AutoModelForSequenceClassification if classify else AutoModelForCausalLM).from_config(config)
        if (model_dir / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(model_dir)
        return model
    from .config import parse_config
    from .models import TINY_BERT, TINY_LLAMA, build_causal_lm, build_sequence_classifier
    from .recipe import RECIPES, recipe_config_class

    if recipe is None:
        raise ConfigError(
            f"{checkpoint}: cannot tell which recipe wrote it: {TRAINER_STATE} names none, there is no "
            f"{MODEL_CONFIG_DIR}/, and config.yaml has keys that none of {', '.join(RECIPES)} knows"
        )
    config = parse_config(recipe_config_class(recipe), config_file=checkpoint / "config.yaml")
    # Same architecture as training, built from the config: a pretrained model's own config.json, or model_config.
    kwargs = {"attn_implementation": config.attn_implementation, "trust_remote_code": config.trust_remote_code}
    if recipe != "classify":
        model_config = config.model_name_or_path or config.model_config or TINY_LLAMA
        return build_causal_lm(tokenizer, model_config=model_config, **kwargs)
    if not config.label_names:
        raise ModelError(
            f"{checkpoint}: an older classify checkpoint (no {MODEL_CONFIG_DIR}/) whose config.yaml has no "
            "label_names: add the run's labels there as label_names, in id order, and export again"
        )
    model_config = config.model_name_or_path or config.model_config or TINY_BERT
    return build_sequence_classifier(tokenizer, config.label_names, model_config=model_config, **kwargs)


def _load_checkpoint_weights(model, checkpoint: Path) -> None:
    """Load the checkpoint's model weights into `model`, every one of them (tied copies aside), or raise."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        weights = checkpoint / "model.safetensors"
        if not weights.is_file() and (checkpoint / "pytorch_model_fsdp_0").is_dir():
            from accelerate.utils import merge_fsdp_weights

            merge_fsdp_weights(str(checkpoint / "pytorch_model_fsdp_0"), tmp, safe_serialization=True)
            weights = Path(tmp) / "model.safetensors"
        if not weights.is_file():
            raise ModelError(f"{checkpoint}: no model weights found (model.safetensors or pytorch_model_fsdp_0/)")
        state_dict = load_file(weights)
    try:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
    except RuntimeError as error:  # a tensor of another shape
        lines = [line.strip() for line in str(error).splitlines() if "size mismatch" in line]
        detail = lines[0] if lines else first_line(error)
        raise ModelError(f"{checkpoint}: weights do not fit the model: {detail}") from None
    tied = {name for name, p in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    if unexpected or set(missing) - tied:
        raise ModelError(
            f"{checkpoint}: weights do not fit the model (missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {unexpected[:5]})"
        )
