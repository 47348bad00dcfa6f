"""From data sources to a tokenised, loss-masked, cached `datasets.Dataset` of conversations."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from ..errors import DataError
from .cache import PREPROCESSING_VERSION, cached_dataset, fingerprint, tokenizer_fingerprint
from .formats import detect_format, to_conversations
from .sources import DataSource, fingerprint_sources, load_source
from .tokenize import tokenize_conversations

__all__ = ["conversation_texts", "load_conversations", "prepare_sft_dataset", "sft_cache_key"]


def load_conversations(
    sources: list[DataSource],
    data_format: str,
    cache_dir: str | Path,
    seed: int,
    num_proc: int | None = None,
    scratch: Path | None = None,
    text_field: str = "text",
) -> datasets.Dataset:
    """All sources, weighted and converted to one `conversation` column of JSON rows (`tunebook.data.formats`)."""
    parts = [
        _conversations(source, data_format, cache_dir, seed, num_proc, scratch, i, text_field)
        for i, source in enumerate(sources)
    ]
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def _conversations(source, data_format, cache_dir, seed, num_proc, scratch, index, text_field) -> datasets.Dataset:
    raw = load_source(source, cache_dir, seed)
    fmt = detect_format(raw.column_names, data_format, source.where, text_field)
    return raw.map(
        to_conversations,
        batched=True,
        with_indices=True,
        fn_kwargs={"data_format": fmt, "where": source.where, "text_field": text_field},
        remove_columns=raw.column_names,
        num_proc=num_proc,
        cache_file_name=str(scratch / f"conversations-{index}.arrow") if scratch else None,
        desc=f"Reading {Path(source.path).name} ({fmt})",
    )


def conversation_texts(conversations: datasets.Dataset) -> Iterator[str]:
    """Plain text of every message with its role (or of every plain-text row), e.g. to train a tokenizer on."""
    for row in conversations["conversation"]:
        example = json.loads(row)
        if "text" in example:
            yield example["text"]
        for m in example.get("messages", []):
            yield f"{m['role']}\n{m['content']}"


def sft_cache_key(
    sources: list[DataSource],
    tokenizer: PreTrainedTokenizerBase,
    data_format: str,
    max_seq_length: int,
    overlong: str,
    assistant_only_loss: bool,
    seed: int,
    text_field: str = "text",
) -> str:
    """Fingerprint of everything a tokenised data set depends on: the cache key of `prepare_sft_dataset`."""
    return fingerprint(
        {
            "sources": fingerprint_sources(sources),
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "data_format": data_format,
            "max_seq_length": max_seq_length,
            "overlong": overlong,
            "assistant_only_loss": assistant_only_loss,
            "text_field": text_field,
            "seed": seed if any(s.weight != 1.0 or s.samples is not None for s in sources) else None,
            "version": PREPROCESSING_VERSION,
        }
    )


def prepare_sft_dataset(
    sources: list[DataSource],
    tokenizer: PreTrainedTokenizerBase,
    *,
    data_format: str,
    max_seq_length: int,
    overlong: str,
    assistant_only_loss: bool,
    cache_dir: str | Path,
    seed: int,
    num_proc: int | None = None,
    key: str | None = None,
    text_field: str = "text",
) -> tuple[datasets.Dataset, dict[str, Any], bool]:
    """Tokenise and mask `sources`, cached by a fingerprint of every input. Returns (dataset, stats, was_cached).

    The dataset has columns `input_ids`, `labels`, `prompt_length`; stats count the examples read, truncated
    and dropped. `key` is `sft_cache_key(...)` of the same arguments, if the caller already computed it.
    """
    args = (data_format, max_seq_length, overlong, assistant_only_loss, seed, text_field)
    key = key or sft_cache_key(sources, tokenizer, *args)

    def build(scratch: Path) -> tuple[datasets.Dataset, dict[str, Any]]:
        parts = []
        for i, source in enumerate(sources):  # one source at a time, so errors name its file and row
            conversations = _conversations(source, data_format, cache_dir, seed, num_proc, scratch, i, text_field)
            parts.append(
                conversations.map(
                    tokenize_conversations,
                    batched=True,
                    with_indices=True,
                    fn_kwargs={
                        "tokenizer": tokenizer,
                        "max_seq_length": max_seq_length,
                        "overlong": overlong,
                        "assistant_only_loss": assistant_only_loss,
                        "where": source.where,
                    },
                    remove_columns=["conversation"],
                    num_proc=num_proc,
                    cache_file_name=str(scratch / f"tokenised-{i}.arrow"),
                    desc="Tokenising",
                )
            )
        tokenised = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
        # Read the flag columns straight from Arrow: `tokenised["keep"]` would build a Python list of every row.
        keep = np.asarray(tokenised.data.column("keep"), dtype=bool)
        truncated = np.asarray(tokenised.data.column("truncated"), dtype=bool)
        dropped_overlong = int((truncated & ~keep).sum()) if overlong == "drop" else 0
        stats = {
            "examples_read": len(tokenised),
            "truncated": int(truncated.sum()) if overlong == "truncate" else 0,
            "dropped_overlong": dropped_overlong,
            "dropped_no_loss_tokens": int((~keep).sum()) - dropped_overlong,
        }
        kept = tokenised.select(np.flatnonzero(keep)).remove_columns(["keep", "truncated"])
        if len(kept) == 0:
            raise DataError(
                f"no examples left to train on from {', '.join(s.path for s in sources)}: "
                f"{stats['dropped_overlong']} longer than max_seq_length={max_seq_length} were dropped and "
                f"{stats['dropped_no_loss_tokens']} had no loss-bearing tokens left (answer truncated away, or the "
                "chat template hides the assistant turn); raise max_seq_length or check the data"
            )
        stats["examples_kept"] = len(kept)
        return kept.flatten_indices(cache_file_name=str(scratch / "kept.arrow")), stats

    return cached_dataset(cache_dir, key, build)
