"""`tunebook export`: a Hugging Face model directory from a training checkpoint of any recipe."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from ..config import saved_recipe
from ..errors import ConfigError, ModelError, first_line
from ..models.quiet import deepspeed_cpu_notice_filtered
from ..models.tokenizer import save_tokenizer
from ..training.checkpoint import MODEL_CONFIG_DIR, TRAINER_STATE, load_trainer_state
from ..training.manifest import MANIFEST, verify_checkpoint

__all__ = ["export_checkpoint"]


def export_checkpoint(
    checkpoint: str | Path, out_dir: str | Path, merge: bool = False, trust_remote_code: bool = False
) -> Path:
    """Write a Hugging Face model directory (safetensors + tokenizer) from a checkpoint of any recipe.

    The model is rebuilt from the checkpoint alone (no Hub, no data): its recorded architecture (`model_config/`),
    a causal LM for sft, pretrain and dpo, a sequence classifier with the run's labels for classify (with one
    output for reward), with the
    weights from the checkpoint: Accelerate's `model.safetensors`, or the sharded state of an FSDP run merged first
    (checkpoints of any number of processes). A checkpoint written before checkpoints held `model_config/` is
    rebuilt from its `config.yaml` (the recipe told by which recipe's config it is, when the trainer state does
    not name it). A LoRA checkpoint gives its adapter directory (with the tokenizer), or with `merge` the adapters
    folded into the base model as a plain model directory.

    The checkpoint is verified against its manifest first: a damaged one stops with what is wrong.

    Args:
        checkpoint: a checkpoint folder, `output_dir/checkpoints/step-<N>`.
        out_dir: the model directory to write (`from_pretrained` loads it).
        merge: for a LoRA checkpoint, write the merged model instead of the adapters.
        trust_remote_code: allow the checkpoint's model (or a LoRA run's base) to run its own Python code. Only the
            caller decides this, never the checkpoint: its `config.yaml` is a file from wherever the checkpoint
            came from, and an export must not run code because that file says so.
    """
    with deepspeed_cpu_notice_filtered():  # save_pretrained imports DeepSpeed, where installed (models.quiet)
        return _export(Path(checkpoint), Path(out_dir), merge, trust_remote_code)


def _export(checkpoint: Path, out_dir: Path, merge: bool, trust_remote_code: bool) -> Path:
    from ..models.vision import load_saved_processor_or_tokenizer

    if not (checkpoint / TRAINER_STATE).is_file() and not (checkpoint / MANIFEST).is_file():
        raise ConfigError(f"{checkpoint} is not a complete Tunebook checkpoint (no {TRAINER_STATE})")
    if problem := verify_checkpoint(checkpoint, logging.getLogger("tunebook")):
        raise ModelError(f"{checkpoint} is damaged: {problem}; export another checkpoint of the run")
    recipe = _checkpoint_recipe(checkpoint)
    if (checkpoint / "adapter").is_dir():
        from ..models.lora import merge_adapter_dir

        if merge:  # the adapter's config names its base model; a classifier's head is among its saved modules
            merge_adapter_dir(checkpoint / "adapter", out_dir, trust_remote_code=trust_remote_code)
        else:
            shutil.copytree(checkpoint / "adapter", out_dir, dirs_exist_ok=True)
            _repoint_base(checkpoint / "adapter", out_dir)
        # a vision-language model's processor (chat template, image processor), or the tokenizer
        save_tokenizer(load_saved_processor_or_tokenizer(checkpoint / "tokenizer", trust_remote_code), out_dir)
        return out_dir
    if merge:
        raise ConfigError(f"--merge: {checkpoint} is not a LoRA checkpoint (no adapter/), its model is whole already")
    tokenizer = load_saved_processor_or_tokenizer(checkpoint / "tokenizer", trust_remote_code)
    model = _rebuild_model(checkpoint, recipe, tokenizer, trust_remote_code)
    _load_checkpoint_weights(model, checkpoint)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(tokenizer, out_dir)
    return out_dir


def _repoint_base(adapter_dir: Path, out_dir: Path) -> None:
    """A copied adapter's config names its local base relative to where it now is (`models.lora.recorded_base`)."""
    from ..models.lora import adapter_base, recorded_base

    path = out_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = recorded_base(adapter_base(adapter_dir)[0], out_dir)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _checkpoint_recipe(checkpoint: Path) -> str | None:
    """The recipe that wrote `checkpoint`, as its trainer state names it; for a checkpoint from before it did (or of
    a recipe of one's own), the first recipe whose config class has every key of its `config.yaml`, or None."""
    import dataclasses

    import yaml

    from ..recipe import RECIPES, recipe_config_class

    recipe = load_trainer_state(checkpoint).get("recipe") or saved_recipe(checkpoint / "config.yaml")
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


def _rebuild_model(checkpoint: Path, recipe: str | None, tokenizer, trust_remote_code: bool):
    """A fresh model (random weights) of the checkpoint's architecture: from `model_config/`, or for an older
    checkpoint from its `config.yaml` as the recipe built it (sft's head when the recipe is unknown)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, GenerationConfig

    from ..models.vision import generative_auto_class
    from ..recipe import recipe_task

    model_dir = checkpoint / MODEL_CONFIG_DIR
    if (model_dir / "config.json").is_file():
        try:
            config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        except ValueError as error:  # custom code that may not run; transformers' message is a paragraph
            if "trust_remote_code" not in str(error):
                raise
            raise ModelError(
                f"{checkpoint}: its model runs its own Python code ({model_dir / 'config.json'} has an auto_map); "
                "export it with --trust_remote_code if you trust where the checkpoint came from"
            ) from None
        heads = config.architectures or []
        classify = (recipe_task(recipe) or ("", ""))[1] == "text-classification" or (
            recipe is None and any(a.endswith("SequenceClassification") for a in heads)
        )
        # a vision-language model's checkpoint rebuilds as one (AutoModelForCausalLM refuses its config)
        auto_class = AutoModelForSequenceClassification if classify else generative_auto_class(config)
        model = auto_class.from_config(config, trust_remote_code=trust_remote_code)
        if (model_dir / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(model_dir)
        return model
    from ..config import parse_config
    from ..config.tiny import TINY_BERT, TINY_LLAMA
    from ..models import build_causal_lm, build_sequence_classifier
    from ..recipe import RECIPES, recipe_config_class

    if recipe is None:
        raise ConfigError(
            f"{checkpoint}: cannot tell which recipe wrote it: {TRAINER_STATE} names none, there is no "
            f"{MODEL_CONFIG_DIR}/, and config.yaml has keys that none of {', '.join(RECIPES)} knows"
        )
    config = parse_config(recipe_config_class(recipe), config_file=checkpoint / "config.yaml")
    # Same architecture as training, built from the config: a pretrained model's own config.json, or model_config.
    # trust_remote_code is the caller's, not the checkpoint config's (see export_checkpoint).
    kwargs = {"attn_implementation": config.attn_implementation, "trust_remote_code": trust_remote_code}
    if recipe == "reward":  # one output, the reward, on the recipe's tiny Llama unless the config names a model
        model_config = config.model_name_or_path or config.model_config or TINY_LLAMA
        return build_sequence_classifier(tokenizer, ["reward"], problem_type="regression", model_config=model_config,
                                         **kwargs)  # fmt: skip
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
