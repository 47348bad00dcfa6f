"""Build a causal LM: `from_pretrained` a local directory or Hub name, or a fresh model from a config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..errors import ConfigError, ModelError, first_line
from ..locations import looks_like_local_path

__all__ = ["build_causal_lm", "build_sequence_classifier", "read_model_config"]


def read_model_config(model_config: dict[str, Any] | str) -> dict[str, Any]:
    """A config dict, or the path of a JSON/YAML file holding one (e.g. a model directory's config.json)."""
    if isinstance(model_config, dict):
        return dict(model_config)
    path = Path(model_config).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"model_config file not found: {model_config}")
    try:
        data = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"model_config {path}: cannot parse: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model_config {path}: expected a mapping, got {type(data).__name__}")
    return data


def build_causal_lm(
    tokenizer: PreTrainedTokenizerBase,
    *,
    model_name_or_path: str | None = None,
    model_config: dict[str, Any] | str | None = None,
    attn_implementation: str | None = None,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    load_in_4bit: bool = False,
) -> PreTrainedModel:
    """Load or build the model and make its embeddings and special token ids agree with `tokenizer`.

    Weights load as safetensors where the directory has them; `trust_remote_code` (running Python shipped with a
    model) stays off unless the config turns it on. `load_in_4bit` quantises the weights for QLoRA (CUDA only).
    """
    model = _load_or_build(
        AutoModelForCausalLM, "a causal LM", tokenizer, model_name_or_path, model_config, attn_implementation,
        trust_remote_code, {}, **quantization(load_in_4bit),
    )  # fmt: skip
    return _finish(model, tokenizer, model_name_or_path, gradient_checkpointing)


def build_sequence_classifier(
    tokenizer: PreTrainedTokenizerBase,
    label_names: list[str],
    *,
    model_name_or_path: str | None = None,
    model_config: dict[str, Any] | str | None = None,
    attn_implementation: str | None = None,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    load_in_4bit: bool = False,
) -> PreTrainedModel:
    """`AutoModelForSequenceClassification` with one output per label and the label names in its config
    (`id2label`/`label2id`), so `pipeline("text-classification", model=output_dir)` prints them.

    A pretrained encoder (or causal LM) gets a freshly initialised classification head; a head of another size
    in the checkpoint is replaced.
    """
    labels = {
        "num_labels": len(label_names),
        "id2label": dict(enumerate(label_names)),
        "label2id": {name: i for i, name in enumerate(label_names)},
        "problem_type": "single_label_classification",
    }
    extra = {"ignore_mismatched_sizes": True, **quantization(load_in_4bit)} if model_name_or_path else {}
    model = _load_or_build(
        AutoModelForSequenceClassification, "a sequence classifier", tokenizer, model_name_or_path, model_config,
        attn_implementation, trust_remote_code, labels, **extra,
    )  # fmt: skip
    return _finish(model, tokenizer, model_name_or_path, gradient_checkpointing)


def quantization(load_in_4bit: bool) -> dict[str, Any]:
    """`from_pretrained` arguments for 4-bit NF4 weights with bf16 compute (QLoRA), on this process's GPU."""
    if not load_in_4bit:
        return {}
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("load_in_4bit (QLoRA) needs a CUDA GPU: bitsandbytes' 4-bit layers do not run on a CPU")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError("load_in_4bit needs bitsandbytes: pip install 'tunebook[qlora]'") from None
    from accelerate import PartialState
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    return {"quantization_config": config, "device_map": {"": PartialState().local_process_index}}


def _load_or_build(
    auto_class, what, tokenizer, model_name_or_path, model_config, attn_implementation, trust_remote_code,
    config_values, **load_kwargs,
) -> PreTrainedModel:  # fmt: skip
    if model_name_or_path and model_config:
        raise ConfigError("give either model_name_or_path (load weights) or model_config (fresh model), not both")
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    kwargs["trust_remote_code"] = trust_remote_code
    if model_name_or_path:
        if looks_like_local_path(model_name_or_path) and not Path(model_name_or_path).expanduser().exists():
            raise ModelError(f"model path not found: {model_name_or_path}")
        try:
            return auto_class.from_pretrained(
                model_name_or_path, dtype="auto", use_safetensors=None, **config_values, **kwargs, **load_kwargs
            )
        except (OSError, ValueError) as e:
            raise ModelError(f"could not load {what} from '{model_name_or_path}': {first_line(e)}") from None
    values = read_model_config(model_config or {})
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ConfigError("model_config needs a 'model_type' (e.g. llama)")
    values.setdefault("vocab_size", len(tokenizer))
    try:
        config = AutoConfig.for_model(model_type, **{**values, **config_values})
        return auto_class.from_config(config, **kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model_config: {first_line(e)}") from None


def _finish(model, tokenizer, model_name_or_path, gradient_checkpointing: bool) -> PreTrainedModel:
    """Embeddings sized for the tokenizer, special token ids in the configs, gradient checkpointing."""
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8)
    # generate() and padding-aware code (sequence classification finds the last token by pad_token_id) read these.
    configs = [model.config] + ([model.generation_config] if getattr(model, "generation_config", None) else [])
    for cfg in configs:
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.eos_token_id = tokenizer.eos_token_id
        if tokenizer.bos_token_id is not None or model_name_or_path is None:
            cfg.bos_token_id = tokenizer.bos_token_id
    if gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and with DDP's unused-parameter checks.
        checkpoint_kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
        model.config.use_cache = False
    return model
