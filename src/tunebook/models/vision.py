"""Vision-language models: any `AutoModelForImageTextToText` with its `AutoProcessor`, and tiny ones built offline.

A model loads by name or path (`build_vision_lm`, `load_processor`) or, for the families in `IMAGE_TOKENS`, is built
from a config (`tunebook.config.tiny`) with a processor made here: a locally trained tokenizer with the family's image
tokens, the family's PIL image processor (torchvision is not needed) and a chat template that renders content parts
(`{"type": "image"}`, `{"type": "text", "text": ...}`) as the family's own template does. The templates are ChatML
underneath, so the text path's assistant-only mask (render and compare, `tunebook.data.tokenize`) finds the assistant
turns, and they carry `{% generation %}` markers over the same spans for `return_assistant_tokens_mask`.

What trains: `freeze_vision` freezes the vision tower (and optionally the projector) found by the model's own module
names; `lora_targets` puts LoRA on the language model's linear layers only (and the projector's, if it trains).

Workarounds for transformers 5.23, each with a test that fails once transformers no longer needs it
(tests/unit/models/test_vision.py): the Qwen-VL processors take a video processor that can be None only past their
class check (`_processor_without_video`), `save_pretrained` then fails on the None (`save_processor`), and
`AutoProcessor.from_pretrained` of a Qwen-VL folder needs torchvision (`load_processor` builds it from its parts).
"""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
)

from ..errors import ConfigError, ModelError, first_line
from ..locations import looks_like_local_path
from .build import ModelOptions, build_causal_lm, finish_model, load_pretrained, read_model_config, torch_dtype
from .saving import save_processor

__all__ = [
    "IMAGE_TOKENS",
    "LLAVA_TEMPLATE",
    "QWEN2_VL_TEMPLATE",
    "build_vision_lm",
    "freeze_vision",
    "generative_auto_class",
    "is_vision_language_model",
    "load_processor",
    "load_saved_processor_or_tokenizer",
    "lora_targets",
    "save_processor",
    "tiny_processor",
    "vision_modules",
]

# The families a tiny model is built for from a config: the special tokens its processor and model expect, by the
# model config key that holds each one's id.
_QWEN_VL_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
IMAGE_TOKENS = {"qwen2_vl": _QWEN_VL_TOKENS, "qwen2_5_vl": _QWEN_VL_TOKENS, "llava": {"image_token_id": "<image>"}}

# ChatML turns, each message's content rendered by the family's `render` macro; an assistant's content and end of turn
# between generation markers, the span the text path's render-and-compare finds too.
_CHATML_TURNS = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- render(message['content']) + '<|im_end|>\n' -}}{%- endgeneration -%}"
    "{%- else -%}{{- render(message['content']) + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

# Qwen2-VL's template (an image part as <|vision_start|><|image_pad|><|vision_end|> where it stands among the text,
# which the processor expands to one <|image_pad|> per 2 x 2 patches), without its default system prompt: the tiny
# models have no persona to keep.
QWEN2_VL_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}" + _CHATML_TURNS
)

# LLaVA's layout (llava-hf's interleave and OneVision templates): a turn's images first, one <image> line each (the
# processor expands it to the tower's fixed token count), then its text, in ChatML turns.
LLAVA_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}"
    "{%- for part in content | selectattr('type', 'equalto', 'image') -%}{{- '<image>\n' -}}{%- endfor -%}"
    "{%- for part in content | selectattr('type', 'equalto', 'text') -%}{{- part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}" + _CHATML_TURNS
)
_TEMPLATES = {"qwen2_vl": QWEN2_VL_TEMPLATE, "qwen2_5_vl": QWEN2_VL_TEMPLATE, "llava": LLAVA_TEMPLATE}

# Where models keep their vision parts (transformers 5): Qwen-VL's `visual` holds its projector (`merger`, and Qwen3-VL's
# `deepstack_merger_list`); LLaVA and Gemma 3 have `vision_tower` and `multi_modal_projector`, Idefics3 and SmolVLM
# `vision_model` and `connector`.
TOWER_NAMES = ("visual", "vision_tower", "vision_model", "vision_encoder")
PROJECTOR_NAMES = ("multi_modal_projector", "connector", "mm_projector", "merger", "deepstack_merger_list")


def is_vision_language_model(
    model: str | dict[str, Any] | PretrainedConfig, trust_remote_code: bool = False, revision: str | None = None
) -> bool:
    """Whether `model` (a name or path, a config file, a config dict with `model_type`, or a config) is one that
    `AutoModelForImageTextToText` builds: its model type maps there, or its remote code registers there. A
    `vision_config` alone is not enough (CLIP and SigLIP have one and generate no text)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if isinstance(model, str) and Path(model).expanduser().is_file():
        model = read_model_config(model)
    elif isinstance(model, str):
        if looks_like_local_path(model) and not Path(model).expanduser().exists():
            raise ModelError(f"model path not found: {model}")
        try:
            kwargs = {"revision": revision} if revision else {}
            model = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code, **kwargs)
        except (OSError, ValueError) as error:
            raise ModelError(f"could not read the model config of '{model}': {first_line(error)}") from None
    values = model if isinstance(model, dict) else model.to_dict()
    auto_map = values.get("auto_map") or {}
    return values.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or (
        "AutoModelForImageTextToText" in auto_map
    )


def generative_auto_class(model: str | PretrainedConfig, trust_remote_code: bool = False, revision: str | None = None):
    """The Auto class that loads a text-generating model from `model` (a name, path or config) with its weights:
    `AutoModelForImageTextToText` for a vision-language model (`AutoModelForCausalLM` refuses its config, and would
    lose the vision tower where it took it), `AutoModelForCausalLM` otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vision = is_vision_language_model(model, trust_remote_code, revision)
    return AutoModelForImageTextToText if vision else AutoModelForCausalLM


def load_saved_processor_or_tokenizer(directory: str | Path, trust_remote_code: bool = False):
    """What a run saved beside its model (a checkpoint's `tokenizer/`, an adapter directory): a vision-language
    model's processor where the folder has `processor_config.json` (`load_processor`, chat template and image
    processor included), else its tokenizer. Re-saved with `save_tokenizer`, either keeps what it had."""
    if (Path(directory) / "processor_config.json").is_file():
        return load_processor(str(directory), trust_remote_code)
    return AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)


def tiny_processor(
    model_config: dict[str, Any] | str, tokenizer: PreTrainedTokenizerBase, max_image_pixels: int = 64 * 64
) -> ProcessorMixin:
    """The processor for a tiny model built from `model_config` (a family of `IMAGE_TOKENS`): a copy of `tokenizer`
    (a chat tokenizer, e.g. `train_chat_tokenizer`'s) with the family's image tokens and chat template, and the
    family's PIL image processor at the vision tower's patch and image sizes. Qwen-VL resizes each image to at most
    `max_image_pixels` (64 x 64: at most 4 image tokens); LLaVA resizes and crops to the tower's image size."""
    values = read_model_config(model_config)
    model_type = values.get("model_type")
    if model_type not in IMAGE_TOKENS:
        raise ConfigError(f"model_config: no tiny processor for model_type {model_type!r} (one of "
                          f"{', '.join(IMAGE_TOKENS)}); load a model and its processor with model_name_or_path")  # fmt: skip
    try:
        config = AutoConfig.for_model(**values)  # the tower's sizes, its defaults filled in
    except (ValueError, TypeError) as error:
        raise ConfigError(f"model_config: {first_line(error)}") from None
    vision = config.vision_config
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens(
        {"extra_special_tokens": list(IMAGE_TOKENS[model_type].values())}, replace_extra_special_tokens=False
    )
    template = _TEMPLATES[model_type]
    tokenizer.chat_template = template  # the text path renders and masks with the tokenizer's template
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil, Qwen2VLProcessor

        factor = vision.patch_size * vision.spatial_merge_size  # the pixels of one image token, each way
        images = Qwen2VLImageProcessorPil(
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size,
            min_pixels=factor * factor,
            max_pixels=max(max_image_pixels, factor * factor),
        )
        processor_class = Qwen2VLProcessor if model_type == "qwen2_vl" else Qwen2_5_VLProcessor
        return _processor_without_video(processor_class, image_processor=images, tokenizer=tokenizer,
                                        chat_template=template)  # fmt: skip
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    side = vision.image_size
    images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=vision.patch_size,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        chat_template=template,
        image_token=IMAGE_TOKENS["llava"]["image_token_id"],
        # CLIP's class token, which the default strategy drops again (SigLIP has none)
        num_additional_image_tokens=1 if vision.model_type == "clip_vision_model" else 0,
    )


def build_vision_lm(
    processor: ProcessorMixin, options: ModelOptions | None = None, **overrides: Any
) -> PreTrainedModel:
    """Load `options.model_name_or_path` as an `AutoModelForImageTextToText`, or build a fresh model from
    `options.model_config` (a family of `IMAGE_TOKENS`; vocabulary size, image token ids and special tokens from the
    processor's tokenizer), then finish it as every model is (`tunebook.models.build.finish_model`)."""
    options = replace(options or ModelOptions(), **overrides)
    tokenizer = processor.tokenizer
    if options.model_name_or_path:
        if options.model_config:
            raise ConfigError("give either model_name_or_path (load weights) or model_config (fresh model), not both")
        model = load_pretrained(AutoModelForImageTextToText, "a vision-language model", options)
    elif options.model_config:
        model = _from_config(read_model_config(options.model_config), tokenizer, options)
    else:
        raise ConfigError("a vision-language model needs model_name_or_path or model_config")
    model = finish_model(model, tokenizer, options)
    if options.gradient_checkpointing:  # the language model reads its own config's use_cache, not the outer one
        model.config.get_text_config().use_cache = False
    return model


def build_chat_lm(tokenizer, processor: ProcessorMixin | None, config) -> PreTrainedModel:
    """A chat recipe's model (sft, dpo, grpo): with a processor, the vision-language model (`build_vision_lm`) with
    its vision tower, and with `freeze_projector` its projector, frozen as the config says; else the causal LM."""
    if processor is None:
        return build_causal_lm(tokenizer, ModelOptions.from_config(config))
    model = build_vision_lm(processor, ModelOptions.from_config(config))
    freeze_vision(model, config.freeze_vision_tower, config.freeze_projector)
    return model


def _from_config(values: dict[str, Any], tokenizer, options: ModelOptions) -> PreTrainedModel:
    model_type = values.pop("model_type", None)
    if model_type not in IMAGE_TOKENS:
        raise ConfigError(f"model_config: model_type {model_type!r} is not a vision-language model Tunebook builds "
                          f"from a config ({', '.join(IMAGE_TOKENS)})")  # fmt: skip
    missing = [token for token in IMAGE_TOKENS[model_type].values() if token not in tokenizer.get_vocab()]
    if missing:
        raise ConfigError(f"model_config: the tokenizer has no {missing[0]} token, which {model_type} needs; use "
                          "tunebook.models.vision.tiny_processor's tokenizer")  # fmt: skip
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in IMAGE_TOKENS[model_type].items()}
    text = dict(values.pop("text_config", None) or {})
    text.setdefault("vocab_size", len(tokenizer))
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        text.setdefault(key, getattr(tokenizer, key))
    kwargs = {"attn_implementation": options.attn_implementation} if options.attn_implementation else {}
    dtype = torch_dtype(options.dtype, options.frozen_base)
    try:
        config = AutoConfig.for_model(model_type, text_config=text, **{**values, **ids})
        return AutoModelForImageTextToText.from_config(
            config, **kwargs, **({"dtype": dtype} if dtype != "auto" else {})
        )
    except (ValueError, TypeError, AssertionError) as error:
        raise ConfigError(f"model_config: {first_line(error)}") from None


def vision_modules(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """The names of `model`'s vision tower(s) and projector(s), found by the names models give them (`TOWER_NAMES`,
    `PROJECTOR_NAMES`; a projector may sit inside the tower, as Qwen-VL's merger does). A ModelError if either is
    not found."""
    towers: list[str] = []
    projectors: list[str] = []
    for name, _ in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in TOWER_NAMES and not _inside(name, towers):
            towers.append(name)
        elif last in PROJECTOR_NAMES and not _inside(name, projectors):
            projectors.append(name)
    what = type(model).__name__
    if not towers:
        raise ModelError(f"{what} has no vision tower Tunebook can find (no module named {', '.join(TOWER_NAMES)}); "
                         "set freeze_vision_tower: false and freeze_projector: false")  # fmt: skip
    if not projectors:
        raise ModelError(f"{what} has no vision projector Tunebook can find (no module named "
                         f"{', '.join(PROJECTOR_NAMES)}); set freeze_vision_tower: false and freeze_projector: false")  # fmt: skip
    return towers, projectors


def _inside(name: str, parents: list[str]) -> bool:
    return any(name.startswith(parent + ".") for parent in parents)


def freeze_vision(model: torch.nn.Module, vision_tower: bool = True, projector: bool = False) -> list[str]:
    """Freeze the vision tower (`freeze_vision_tower`, all of it but a projector inside it) and the projector
    (`freeze_projector`); returns the names of the modules frozen. The language model is left as it is."""
    if not (vision_tower or projector):
        return []
    towers, projectors = vision_modules(model)
    modules = dict(model.named_modules())
    in_projector = {id(p) for name in projectors for p in modules[name].parameters()}
    frozen = []
    if vision_tower:
        for name in towers:
            for parameter in modules[name].parameters():
                if id(parameter) not in in_projector:
                    parameter.requires_grad_(False)
        frozen += towers
    if projector:
        for name in projectors:
            modules[name].requires_grad_(False)
        frozen += projectors
    return frozen


def lora_targets(model: torch.nn.Module, projector: bool = False) -> str:
    """The default `lora_target_modules` of a vision-language model: a regex (peft matches it against whole module
    names) naming every linear layer of the language model, and of the projector with `projector` (when it trains),
    but none of the vision tower's or the output head. peft's `all-linear` would adapt the tower too. A projector
    without linear layers (Gemma 3's is a weight matrix) gets no adapters: it trains only in full fine-tuning."""
    decoder = model.get_decoder()
    names = {id(module): name for name, module in model.named_modules()}
    if decoder is model or id(decoder) not in names:
        raise ModelError(f"{type(model).__name__}: cannot find its language model (get_decoder)")
    prefixes = [names[id(decoder)]] + (vision_modules(model)[1] if projector else [])
    alternatives = []
    for prefix in prefixes:
        linear = sorted({
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.startswith(prefix + ".")
        })  # fmt: skip
        if linear:
            alternatives.append(rf"{re.escape(prefix)}\.(?:.*\.)?(?:{'|'.join(map(re.escape, linear))})")
    return "^(?:" + "|".join(alternatives) + ")$"


def load_processor(name_or_path: str, trust_remote_code: bool = False, revision: str | None = None) -> ProcessorMixin:
    """`AutoProcessor.from_pretrained` with one-line errors. Without torchvision a Qwen-VL processor does not load
    that way (transformers 5.23 loads its video processor, which needs torchvision): it is built from its tokenizer,
    PIL image processor and chat template instead, without a video processor (images only)."""
    path = Path(name_or_path).expanduser()
    if looks_like_local_path(name_or_path) and not path.exists():
        raise ModelError(f"processor path not found: {name_or_path}")
    if path.is_file():
        raise ModelError(f"{name_or_path} is a file, not a model directory (a folder with processor_config.json) or "
                         "a Hub name")  # fmt: skip
    kwargs = {"revision": revision} if revision else {}
    kind = "directory" if looks_like_local_path(name_or_path) else "Hub name"
    try:
        try:
            processor = AutoProcessor.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **kwargs)
        except (ValueError, ImportError) as error:
            if "torchvision" not in str(error).lower():
                raise
            processor = _processor_from_parts(name_or_path, trust_remote_code, kwargs)
    except (OSError, ValueError, TypeError, ImportError) as error:
        raise ModelError(f"could not load a processor from {kind} '{name_or_path}': {first_line(error)}") from None
    if not isinstance(processor, ProcessorMixin):  # a text-only model's AutoProcessor is its tokenizer
        raise ModelError(f"'{name_or_path}' has no image processor: not a vision-language model")
    tokenizer = processor.tokenizer
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of attention and loss: any token serves
    return processor


def _processor_from_parts(name_or_path: str, trust_remote_code: bool, kwargs: dict) -> ProcessorMixin:
    import transformers

    processor_dict, _ = ProcessorMixin.get_processor_dict(name_or_path, **kwargs)
    processor_class = getattr(transformers, processor_dict.get("processor_class", ""), None)
    if processor_class is None or "video_processor" not in processor_class.get_attributes():
        raise ValueError(f"{name_or_path}: its processor needs torchvision, which is not installed")
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **kwargs)
    images = AutoImageProcessor.from_pretrained(name_or_path, backend="pil", **kwargs)
    template = processor_dict.get("chat_template") or tokenizer.chat_template
    return _processor_without_video(processor_class, image_processor=images, tokenizer=tokenizer,
                                    chat_template=template)  # fmt: skip


def _processor_without_video(processor_class, **parts) -> ProcessorMixin:
    """`processor_class(**parts, video_processor=None)` (a Qwen-VL processor, images only), past the check of each
    part's class that refuses None: and without torchvision the check cannot even find the video processor's base
    class (transformers 5.23: `VideoProcessorMixin` is not exported, and `get_possibly_dynamic_module` fails on the
    torchvision dummy of `VIDEO_PROCESSOR_MAPPING`). Only this instance skips that one check, for its construction."""
    processor = processor_class.__new__(processor_class)
    check = processor.check_argument_for_proper_class
    processor.check_argument_for_proper_class = lambda name, value: (
        None if name == "video_processor" and value is None else check(name, value)
    )
    try:
        processor_class.__init__(processor, video_processor=None, **parts)
    finally:
        del processor.check_argument_for_proper_class
    return processor
