"""Model and tokenizer construction."""

from .build import build_causal_lm, build_sequence_classifier, model_options, read_model_config, torch_dtype
from .lora import (
    apply_lora,
    describe_parameters,
    is_peft_model,
    merge_adapter_dir,
    parameter_counts,
    register_adapter_checkpoints,
    save_adapter,
)
from .tiny import TINY_BERT, TINY_LLAMA
from .tokenizer import (
    CHATML_TEMPLATE,
    load_or_train_tokenizer,
    load_tokenizer,
    setup_chat_template,
    train_chat_tokenizer,
    train_encoder_tokenizer,
)

__all__ = [
    "CHATML_TEMPLATE",
    "TINY_BERT",
    "TINY_LLAMA",
    "apply_lora",
    "build_causal_lm",
    "describe_parameters",
    "is_peft_model",
    "merge_adapter_dir",
    "parameter_counts",
    "register_adapter_checkpoints",
    "save_adapter",
    "build_sequence_classifier",
    "model_options",
    "torch_dtype",
    "setup_chat_template",
    "load_or_train_tokenizer",
    "load_tokenizer",
    "read_model_config",
    "train_chat_tokenizer",
    "train_encoder_tokenizer",
]
