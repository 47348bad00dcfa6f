"""Model construction: build or load models (`build`), LoRA (`lora`), GGUF
conversion (`gguf`), the model inside distributed and compiled wrappers (`wrappers`), the tokenizer set-up
(`tokenizer`), attention over packed rows and the choice of its backend (`attention`), vision-language models and
their processors (`vision`). Names load on first use:
`import tunebook.models` imports no model code."""

from __future__ import annotations

import importlib

_LAZY = {
    "tunebook.models.build": [
        "ModelOptions", "build_causal_lm", "build_sequence_classifier", "model_options", "read_model_config", "torch_dtype",
        "whole_weights",
    ],
    "tunebook.models.lora": [
        "apply_lora", "describe_parameters", "is_peft_model", "load_adapter_model", "merge_adapter_dir",
        "parameter_counts", "register_adapter_checkpoints",
    ],
    "tunebook.models.vision": [
        "build_chat_lm", "build_vision_lm", "freeze_vision", "is_vision_language_model", "load_processor", "lora_targets",
        "save_processor", "tiny_processor",
    ],
    "tunebook.models.wrappers": ["unwrap"],
    "tunebook.models.attention": ["attention_inputs", "packing_mechanism", "use_packed_attention"],
    "tunebook.models.tokenizer": [
        "CHATML_TEMPLATE", "load_or_train_tokenizer", "load_tokenizer", "save_tokenizer", "setup_chat_template",
        "train_chat_tokenizer", "train_encoder_tokenizer",
    ],
}  # fmt: skip
_WHERE = {name: module for module, names in _LAZY.items() for name in names}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'tunebook.models' has no attribute {name!r}")
