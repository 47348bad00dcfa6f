"""Saving tokenizers so that the saved folder loads the same way anywhere."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["LOADING_KWARGS", "save_tokenizer"]

# What transformers' `from_pretrained` records in a tokenizer's init_kwargs about how it was loaded (from a local
# folder, offline), which `save_pretrained` would write into tokenizer_config.json: a saved model would then tell
# whoever loads it, on another machine, that it is local and to be loaded from local files only.
LOADING_KWARGS = ("is_local", "local_files_only")


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, directory: str | Path) -> None:
    """`tokenizer.save_pretrained(directory)` without the loading flags (`LOADING_KWARGS`) in its config."""
    for key in LOADING_KWARGS:
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(directory)
