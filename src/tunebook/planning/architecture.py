"""The model a plan is for, built from its `config.json` alone as fake tensors: shapes and dtypes, no weights.

A Hub name costs one small download (`config.json`, through transformers' cache); `--architecture` points at a
config.json instead (offline, or a model not yet published). The model is built exactly as the recipe builds it
(dtype, LoRA adapters, a classification head), so its parameter counts, dtypes and modules are the run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import compat
from ..errors import ConfigError
from ..models.build import read_model_config, torch_dtype
from ..models.gguf import resolve_model_name

__all__ = ["Architecture", "build_architecture", "model_config_of", "teacher_parameters"]

# What 4-bit NF4 with double quantisation (QLoRA, bitsandbytes) stores per weight: 4 bits, plus one 8-bit absmax
# per 64 weights and one float32 per 256 of those (Dettmers et al. 2023, section 2).
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 4 / (64 * 256)


@dataclass
class Architecture:
    """A fake-tensor model (`model`) and the figures a plan reads from it."""

    model: torch.nn.Module
    model_config: Any
    task: str  # causal_lm, classify (a sequence classifier) or reward (one regression output)
    params: int
    trainable: int
    weight_bytes: float  # in memory on one device holding it all (4-bit weights at NF4's size)
    trainable_bytes: int
    largest_block: int  # parameters of the largest repeated block (what FSDP2 or ZeRO-3 gathers at once)
    vocab: int
    blocks: int
    kv_bytes_per_token: int  # a generation's key/value cache per token, in the compute dtype


def model_config_of(config, architecture: str | Path | None = None):
    """The transformers config of the model `config` trains: `architecture` (a config.json or its directory)
    when given, else `model_name_or_path`'s config.json (a local directory, a `pip:` model, or the Hub), else the
    fresh model of `model_config` (the recipe's tiny default when it names none)."""
    from transformers import AutoConfig

    if architecture is not None:
        path = Path(architecture).expanduser()
        folder = path.parent if path.is_file() else path
        if not (folder / "config.json").is_file():
            raise ConfigError(f"--architecture {architecture}: no config.json there")
        return _config_from(AutoConfig.from_pretrained, str(folder), architecture, config)
    if config.model_name_or_path:
        name = resolve_model_name(config.model_name_or_path)
        kwargs = {"revision": config.model_revision} if config.model_revision else {}
        return _config_from(AutoConfig.from_pretrained, name, config.model_name_or_path, config, **kwargs)
    values = read_model_config(config.model_config or {})
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ConfigError("model_config needs a 'model_type' (e.g. llama)")
    values.setdefault("vocab_size", getattr(config, "tokenizer_vocab_size", 32000))
    return AutoConfig.for_model(model_type, **values)


def teacher_parameters(config, architecture: str | Path | None = None) -> tuple[int | None, str]:
    """The parameters of a distillation run's teacher (its config.json: `architecture`, else what
    `teacher_model_name_or_path` or `teacher_model_config` names), counted on the meta device; (None, why) when its
    config.json cannot be read here (a Hub name offline): the plan then counts the teacher at the student's size."""
    import copy

    from ..models.vision import generative_auto_class

    teacher = copy.copy(config)
    teacher.model_name_or_path, teacher.model_config = config.teacher_model_name_or_path, config.teacher_model_config
    teacher.model_revision = None
    try:
        model_config = model_config_of(teacher, architecture)
    except ConfigError as error:
        return None, f"the teacher counted at the student's size: {error}".replace(
            "--architecture", "--teacher_architecture"
        )
    with torch.device("meta"):  # shapes only: a 70B teacher in no memory
        model = generative_auto_class(model_config).from_config(model_config)
    return sum(p.numel() for p in model.parameters()), ""


def _config_from(load, name: str, shown, config, **kwargs):
    try:
        return load(name, trust_remote_code=config.trust_remote_code, **kwargs)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"could not read the config.json of {shown} ({reason}); plan offline with "
                          "--architecture PATH/config.json") from None  # fmt: skip


def build_architecture(config, model_config, task: str, compute_dtype: torch.dtype | None, sharded: bool,
                       labels: int = 2, traced: bool = True) -> Architecture:  # fmt: skip
    """The model of `config` (its dtype, LoRA adapters, gradient checkpointing) as fake tensors, or with `traced`
    false left on the meta device (counted, not run: seconds saved on a 70B model).

    `compute_dtype`: the dtype FSDP2 or DeepSpeed casts the weights to (their mixed precision), None for the
    weights' own dtype (single device and DDP, where autocast computes over them)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForCausalLM if task == "causal_lm" else AutoModelForSequenceClassification
    if task != "causal_lm":
        model_config.num_labels = labels
        model_config.problem_type = "regression" if task == "reward" else "single_label_classification"
    if getattr(model_config, "pad_token_id", None) is None:
        model_config.pad_token_id = 0  # a sequence classifier finds each row's last token by it
    stored = getattr(model_config, "dtype", None) or torch.float32
    dtype = torch_dtype(config.dtype, config.use_peft or config.load_in_4bit)
    dtype = _dtype(stored) if dtype == "auto" else dtype
    if compute_dtype is not None and not config.use_peft:
        dtype = compute_dtype  # the sharded copy is float32 (see `plan`); what the forward sees is this
    attention = config.attn_implementation or "sdpa"
    # Built on the meta device (peft's adapters too: it moves them to their layer's device, which fake tensors
    # refuse), then given fake storage: shapes, dtypes and a CPU device for the trace's kernels to dispatch on.
    with torch.device("meta"):
        model = auto.from_config(model_config, dtype=dtype, attn_implementation=_traced(attention))
    if config.use_peft or config.load_in_4bit:
        from ..models.lora import apply_lora

        model = apply_lora(model, config, "causal_lm" if task == "causal_lm" else "classification")
    if traced:
        with compat.fake_tensor_mode():
            model.to_empty(device="cpu")
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        inner.tie_weights()  # to_empty gave the tied embeddings and head a parameter each
    model.train()
    if config.gradient_checkpointing:  # as `models.build` turns it on
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    params = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    head = _head(model)
    weight_bytes = sum(_bytes(p, name, config.load_in_4bit, head) for name, p in model.named_parameters())
    text = getattr(model_config, "text_config", None) or model_config
    heads = getattr(text, "num_attention_heads", 1)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    layers = getattr(text, "num_hidden_layers", 1)
    element = torch.empty((), dtype=compute_dtype or dtype).element_size()
    return Architecture(
        model=model,
        model_config=model_config,
        task=task,
        params=params,
        trainable=sum(p.numel() for p in trainable),
        weight_bytes=weight_bytes,
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
        largest_block=max((sum(p.numel() for p in b.parameters()) for b in _blocks(model)), default=params),
        vocab=getattr(text, "vocab_size", 0) or 0,
        blocks=len(_blocks(model)),
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * element,
    )


def _traced(attention: str) -> str:
    """The attention a plan traces: an efficient kernel's memory (no `length x length` scores kept) for every
    backend that has one; eager keeps its scores, as it does in a run."""
    return "eager" if attention == "eager" else "sdpa"


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(value),
                                                                                              torch.float32)  # fmt: skip


def _head(model) -> torch.nn.Module | None:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None


def _bytes(parameter: torch.Tensor, name: str, four_bit: bool, head) -> float:
    """A weight's bytes in memory: bitsandbytes quantises the base's linear layers (not embeddings, the output
    layer or LoRA's own) to NF4."""
    if four_bit and not parameter.requires_grad and parameter.dim() == 2 and "embed" not in name:
        if head is None or parameter is not getattr(head, "weight", None):
            return parameter.numel() * NF4_BYTES_PER_WEIGHT
    return parameter.numel() * parameter.element_size()


def _blocks(model) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 wraps one by one (transformers' `_no_split_modules`: decoder layers, a vision
    tower's layers)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(compat.no_split_modules(inner))
    return [m for m in inner.modules() if type(m).__name__ in names]
