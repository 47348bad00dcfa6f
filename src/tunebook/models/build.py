"""Build a causal LM: `from_pretrained` a local directory or Hub name, or a fresh model from a config."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, replace
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
from .fused_cpu import set_fused_cpu_layers
from .gguf import resolve_model_name

__all__ = [
    "ModelOptions", "build_causal_lm", "build_sequence_classifier", "eos_ids", "finish_model", "load_pretrained",
    "model_options", "read_model_config", "torch_dtype", "whole_weights",
]  # fmt: skip

logger = logging.getLogger("tunebook")


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


@dataclass(frozen=True)
class ModelOptions:
    """How a recipe's model is loaded or built: the options `build_causal_lm` and `build_sequence_classifier` share.

    Weights load from safetensors only unless `use_safetensors` is False; `trust_remote_code` (running Python shipped
    with a model) stays off unless the config turns it on. `load_in_4bit` quantises the weights for QLoRA (CUDA
    only). `dtype` auto keeps trained weights in float32 (`frozen_base`: LoRA's base stays as stored).
    """

    model_name_or_path: str | None = None  # load weights (a local directory or a Hub name) ...
    model_config: dict[str, Any] | str | None = None  # ... or build a fresh model from this config
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    load_in_4bit: bool = False
    dtype: str = "auto"
    revision: str | None = None
    use_safetensors: bool = True
    frozen_base: bool = False
    use_liger_kernel: bool = False
    fused_cpu_layers: bool = True

    @classmethod
    def from_config(cls, config) -> ModelOptions:
        """A recipe config's options (its `model_config` is the recipe's tiny model when it names no model)."""
        return cls(
            model_name_or_path=config.model_name_or_path,
            model_config=config.model_config,
            attn_implementation=config.attn_implementation,
            gradient_checkpointing=config.gradient_checkpointing,
            trust_remote_code=config.trust_remote_code,
            load_in_4bit=config.load_in_4bit,
            dtype=config.dtype,
            revision=config.model_revision,
            use_safetensors=config.use_safetensors,
            frozen_base=config.use_peft,
            use_liger_kernel=config.use_liger_kernel,
            fused_cpu_layers=config.fused_cpu_layers,
        )


model_options = ModelOptions.from_config  # what recipes call: build_causal_lm(tokenizer, model_options(config))


def _options(options: ModelOptions | None, overrides: dict[str, Any]) -> ModelOptions:
    """`options` (the defaults when None) with the fields given by keyword replaced: `build_causal_lm(tokenizer,
    model_config=...)` reads as before."""
    return replace(options or ModelOptions(), **overrides)


def build_causal_lm(
    tokenizer: PreTrainedTokenizerBase, options: ModelOptions | None = None, **overrides: Any
) -> PreTrainedModel:
    """Load or build the model (`ModelOptions`, any field of which may also be given by keyword) and make its
    embeddings and special token ids agree with `tokenizer`."""
    options = _options(options, overrides)
    model = _load_or_build(AutoModelForCausalLM, "a causal LM", tokenizer, options, {}, **_load_options(options))
    return finish_model(model, tokenizer, options)


def build_sequence_classifier(
    tokenizer: PreTrainedTokenizerBase,
    label_names: list[str],
    options: ModelOptions | None = None,
    *,
    problem_type: str = "single_label_classification",
    **overrides: Any,
) -> PreTrainedModel:
    """`AutoModelForSequenceClassification` with one output per label and the label names in its config
    (`id2label`/`label2id`), so `pipeline("text-classification", model=output_dir)` prints them; loaded or built as
    `build_causal_lm` does.

    A pretrained encoder (or causal LM) gets a freshly initialised classification head; a head of another size
    in the checkpoint is replaced. A reward model is one label with `problem_type` regression: its output is the
    score itself (a pipeline applies no softmax or sigmoid to it).
    """
    options = _options(options, overrides)
    labels = {
        "num_labels": len(label_names),
        "id2label": dict(enumerate(label_names)),
        "label2id": {name: i for i, name in enumerate(label_names)},
        "problem_type": problem_type,
    }
    extra = _load_options(options)
    if options.model_name_or_path:
        extra["ignore_mismatched_sizes"] = True
    model = _load_or_build(AutoModelForSequenceClassification, "a sequence classifier", tokenizer, options, labels,
                           **extra)  # fmt: skip
    return finish_model(model, tokenizer, options)


def load_pretrained(auto_class, what: str, options: ModelOptions) -> PreTrainedModel:
    """`auto_class.from_pretrained(options.model_name_or_path)` with the checks and one-line errors of
    `build_causal_lm` (a missing path, a file, pickled weights, an offline Hub name), for a model class whose configs
    `build_causal_lm` cannot build (a vision-language model: `tunebook.models.vision`). `what` names it in errors."""
    return _load_or_build(auto_class, what, None, options, {}, **_load_options(options))


def _load_options(options: ModelOptions) -> dict:
    """`from_pretrained`/`from_config` keyword arguments: dtype (see `torch_dtype`), revision, safetensors, 4-bit."""
    kwargs = {
        "dtype": torch_dtype(options.dtype, options.frozen_base),
        "use_safetensors": options.use_safetensors,
        **quantization(options.load_in_4bit),
    }
    if options.revision:
        kwargs["revision"] = options.revision
    return kwargs


def torch_dtype(dtype: str, frozen_base: bool = False):
    """The dtype weights are loaded in. auto: float32, so the weights the optimizer updates keep every bit (mixed
    precision computes in bf16/fp16 over them; loading a bf16 checkpoint "as stored" would train bf16 weights); a
    frozen LoRA base stays as stored ("auto" to transformers), it never takes an update."""
    import torch

    if dtype == "auto":
        return "auto" if frozen_base else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


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


def refuse_pickled_weights(model_dir: str | Path, use_safetensors: bool) -> None:
    """Stop at a local model directory whose weights are only pickled (.bin, .pt), which can run code when loaded,
    unless `use_safetensors` is false; `from_pretrained(use_safetensors=True)` would fail on it less clearly."""
    path = Path(model_dir).expanduser()
    if use_safetensors and path.is_dir() and not any(path.glob("*.safetensors")):
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise ModelError(
                f"{model_dir} has only pickled .bin weights, which can run code when loaded; convert them to "
                "safetensors, or set use_safetensors: false if you trust their source"
            )


class _LoadReport(logging.Filter):
    """transformers 5 logs a "LOAD REPORT" table, in terminal colours, at every `from_pretrained` that did not load
    every weight, even the expected case of a new classification head on an encoder. While loading, the report is
    held back (a filter on that one logger); `log_keys` then says the same in a line or two, and a load that fails
    lets it through, as the error refers to it."""

    logger = logging.getLogger("transformers.modeling_utils")

    def __enter__(self) -> _LoadReport:
        self.held: list[logging.LogRecord] = []
        self.logger.addFilter(self)
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.logger.removeFilter(self)
        if error is not None:
            for record in self.held:
                self.logger.handle(record)

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            self.held.append(record)
            return False
        return True

    def log_keys(self, info: dict[str, Any], source: str) -> None:
        missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
        if missing:
            logger.info("Not in %s, so newly initialised (trained from a random start): %s", source, _names(missing))
        if unexpected:
            logger.info("In %s but not used by this model: %s", source, _names(unexpected))
        if mismatched := sorted(key for key, *_ in info.get("mismatched_keys") or ()):
            logger.info("Of another shape in %s, so newly initialised: %s", source, _names(mismatched))


def _names(keys: list[str], shown: int = 6) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(keys[:shown]) + more


def _load_or_build(
    auto_class, what, tokenizer, options: ModelOptions, config_values, **load_kwargs
) -> PreTrainedModel:
    model_name_or_path, model_config = options.model_name_or_path, options.model_config
    attn_implementation, trust_remote_code = options.attn_implementation, options.trust_remote_code
    if model_name_or_path and model_config:
        raise ConfigError("give either model_name_or_path (load weights) or model_config (fresh model), not both")
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    kwargs["trust_remote_code"] = trust_remote_code
    if model_name_or_path:
        model_name_or_path = resolve_model_name(model_name_or_path)  # pip:PACKAGE: the model it installs
        path = Path(model_name_or_path).expanduser()
        if looks_like_local_path(model_name_or_path) and not path.exists():
            raise ModelError(f"model path not found: {model_name_or_path}")
        if path.is_file():  # transformers would call it a directory without a config.json
            raise ModelError(f"model_name_or_path {model_name_or_path} is a file, not a model directory (a folder "
                             "with config.json) or a Hub name")  # fmt: skip
        refuse_pickled_weights(model_name_or_path, load_kwargs.get("use_safetensors", True))
        try:
            with _LoadReport() as report:
                model, info = auto_class.from_pretrained(
                    model_name_or_path, **config_values, **kwargs, **load_kwargs, output_loading_info=True
                )
        except (OSError, ValueError) as e:
            raise ModelError(f"could not load {what} from '{model_name_or_path}': {_reason(e)}") from None
        report.log_keys(info, model_name_or_path)
        return model
    values = read_model_config(model_config or {})
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ConfigError("model_config needs a 'model_type' (e.g. llama)")
    values.setdefault("vocab_size", len(tokenizer))
    try:
        defaults = AutoConfig.for_model(model_type)
        # Embeddings take their padding row from the config as they are built (RoBERTa's and OPT's default is 1, our
        # tokenizers' [UNK]; ModernBERT's and Phi-3's lie outside a small vocabulary); architectures without such
        # defaults (Llama) keep None, so no row of theirs is frozen as padding.
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(defaults, key, None) is not None and getattr(tokenizer, key) is not None:
                values.setdefault(key, getattr(tokenizer, key))
        config = AutoConfig.for_model(model_type, **{**values, **config_values})
        dtype = load_kwargs.get("dtype")
        model = auto_class.from_config(config, **kwargs, **({"dtype": dtype} if dtype != "auto" else {}))
    except (ValueError, TypeError, AssertionError) as e:
        raise ConfigError(f"model_config: {_reason(e)}") from None
    _check_padding_rows(model, tokenizer, model_type)
    return model


def _reason(error: Exception) -> str:
    """transformers' first line, with the config key to set where it names a keyword argument."""
    reason = first_line(error)
    if "attn_implementation" in reason:
        reason += " (config key attn_implementation, e.g. --attn_implementation eager)"
    return reason


def _check_padding_rows(model, tokenizer, model_type: str) -> None:
    """A fresh model's embeddings must treat the tokenizer's pad token, and only it, as padding (a padding row is
    never trained, and RoBERTa-style position ids restart at it). MPNet's are fixed at id 1 whatever the config."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and module.padding_idx not in (None, tokenizer.pad_token_id):
            raise ConfigError(f"model_config: {model_type}'s {name} treats token id {module.padding_idx} as padding, "
                              f"but the tokenizer pads with id {tokenizer.pad_token_id}; use a tokenizer whose pad "
                              f"token has id {module.padding_idx}, or another model_type")  # fmt: skip


def finish_model(model, tokenizer, options: ModelOptions):
    """Embeddings sized for the tokenizer, special token ids in the configs, gradient checkpointing, Liger's
    kernels, the fused CPU layers: what every built or loaded model gets."""
    model_name_or_path = options.model_name_or_path
    rows = _rows(model.get_input_embeddings().weight)
    if len(tokenizer) > rows:
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8, mean_resizing=False)
        _mean_init_new_rows(model, rows)
        model.new_token_rows = range(rows, len(tokenizer))  # LoRA trains these rows too (models.lora)
        logger.info("Embeddings resized from %d to %d rows for the tokenizer's new tokens (initialised to the mean "
                    "embedding)", rows, _rows(model.get_input_embeddings().weight))  # fmt: skip
    # generate() and padding-aware code (sequence classification finds the last token by pad_token_id) read these.
    # A model's own EOS ids stay EOS ids in generation (Llama 3 Instruct has three); the tokenizer's comes first.
    eos = eos_ids(tokenizer.eos_token_id, model_name_or_path and getattr(model, "generation_config", None))
    configs = [model.config] + ([model.generation_config] if getattr(model, "generation_config", None) else [])
    for cfg in configs:
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.eos_token_id = eos
        if tokenizer.bos_token_id is not None or model_name_or_path is None:
            cfg.bos_token_id = tokenizer.bos_token_id
    _log_dtype(model, options.dtype, options.frozen_base)
    if options.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and with DDP's unused-parameter checks.
        checkpoint_kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
        model.config.use_cache = False
    if options.use_liger_kernel:
        from .kernels import apply_liger_kernel

        apply_liger_kernel(model)
    fused = set_fused_cpu_layers(model, options.fused_cpu_layers and not options.use_liger_kernel)
    if fused:
        logger.info("fused_cpu_layers: on a CPU, %s run as fused autograd functions", ", ".join(fused))
    return model


def _mean_init_new_rows(model, old_rows: int) -> None:
    """New token rows (input and output embeddings) = the mean of the trained rows: a start close to what the model
    knows, rather than random vectors whose large logits would dominate the first steps."""
    import torch

    layers = [model.get_input_embeddings(), model.get_output_embeddings()]
    for layer in {id(x): x for x in layers if x is not None and _rows(x.weight) > old_rows}.values():
        with torch.no_grad(), whole_weights(layer):
            layer.weight[old_rows:] = layer.weight[:old_rows].mean(dim=0, keepdim=True)


def _rows(weight) -> int:
    # Under DeepSpeed ZeRO-3, transformers builds the model already partitioned (`zero.Init`): each process holds
    # an empty tensor in place of the weight, whose full shape is `ds_shape`.
    return getattr(weight, "ds_shape", weight.shape)[0]


def _partitioned_params(module) -> list:
    return [p for p in module.parameters() if hasattr(p, "ds_id")]  # DeepSpeed ZeRO-3's mark of a partitioned weight


def is_partitioned(module) -> bool:
    """Whether DeepSpeed ZeRO-3 has partitioned `module`'s weights."""
    return bool(_partitioned_params(module))


def whole_weights(module):
    """While inside, a DeepSpeed ZeRO-3 partitioned `module` holds its whole weights in every process, so it can be
    edited, trained, run or copied as a plain module before `accelerator.prepare` hands it to the engine; on leaving,
    process 0's weights are partitioned again (every process ran the same steps on the same data). Nothing for a
    module that is not partitioned."""
    params = _partitioned_params(module)
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def eos_ids(eos_id: int | None, generation_config) -> int | list[int] | None:
    """`eos_id` first, then every other EOS id of `generation_config` (None, or one id or a list): one id as an int,
    several as a list, none as None."""
    previous = getattr(generation_config, "eos_token_id", None) if generation_config else None
    previous = previous if isinstance(previous, list) else [] if previous is None else [previous]
    ids = ([eos_id] if eos_id is not None else []) + [i for i in previous if i != eos_id]
    return ids[0] if len(ids) == 1 else (ids or None)


def _log_dtype(model, dtype: str, frozen_base: bool) -> None:
    weights = str(next(model.parameters()).dtype).removeprefix("torch.")
    if dtype == "auto" and not frozen_base:
        logger.info("Weights in %s: the trained weights stay float32 (mixed precision, if set, computes in half "
                    "precision over them)", weights)  # fmt: skip
    elif frozen_base:
        logger.info("Frozen base weights in %s (%s); the adapters train in float32", weights,
                    "as stored" if dtype == "auto" else "dtype")  # fmt: skip
    else:
        logger.warning("dtype %s: the trained weights are %s too, so small updates can round away; dtype auto keeps "
                       "float32 weights under bf16/fp16 mixed precision", dtype, weights)  # fmt: skip
