"""Model and tokenizer construction."""

from .build import build_causal_lm, read_model_config
from .tiny import TINY_LLAMA
from .tokenizer import CHATML_TEMPLATE, load_or_train_tokenizer, load_tokenizer, train_chat_tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "TINY_LLAMA",
    "build_causal_lm",
    "load_or_train_tokenizer",
    "load_tokenizer",
    "read_model_config",
    "train_chat_tokenizer",
]
