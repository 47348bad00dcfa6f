"""Supervised fine-tuning data: sources -> conversations -> tokenised, loss-masked examples -> packed rows, each
cached under a fingerprint of everything it depends on.

`prepare_sft_data` is what both `recipes/sft.py` and `tunebook prepare` call, so preparing ahead of time builds
exactly the caches a training run with the same config looks up. `prepare_sft_dataset` is the tokenising step on
its own (sources and a tokenizer in, a cached `datasets.Dataset` out).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from ..errors import ConfigError, DataError
from ..models.tokenizer import setup_chat_template
from .cache import PREPROCESSING_VERSION, cached_dataset, fingerprint, tokenizer_fingerprint
from .formats import detect_format, to_conversations
from .packing import example_lengths, pack_dataset
from .pipeline import Pipeline, PreparedData, Tokenised
from .sources import DataSource, fingerprint_sources, load_source
from .stream import (
    ChatRows,
    Mixture,
    TokenStream,
    prepared_tokenizer,
    process_position,
    source_names,
    stream_fingerprint,
)
from .synthetic import write_synthetic_task
from .tokenize import longest_token_chars, tokenize_conversations

__all__ = [
    "SFTData",
    "SFTPipeline",
    "conversation_texts",
    "held_out_split",
    "load_conversations",
    "prepare_sft_data",
    "prepare_sft_dataset",
    "sft_cache_key",
]


PACKING_VERSION = "1"  # bump when packing changes what it produces
TOKENIZER_EXAMPLES = 20_000  # a tokenizer trained on streamed data learns from its first conversations


@dataclass(kw_only=True)
class SFTData(PreparedData):
    """The prepared data of an SFT run: `train` and `eval` are packed rows when packing, else tokenised examples."""

    eval_examples: datasets.Dataset | None = None  # unpacked eval examples, for generation eval


def prepare_sft_data(config, cache_dir: Path, log: logging.Logger) -> SFTData:
    """Sources -> tokenizer -> tokenised (and packed) train and eval sets, each from the cache when unchanged.

    `config` is an `SFTConfig`. In multi-process runs call it through
    `tunebook.distributed.prepare_then_join`: the first process builds the caches, the others find them finished.
    """
    return SFTPipeline(config, cache_dir, log).prepare()


class SFTPipeline(Pipeline):
    """SFT's steps: conversations tokenised and loss-masked, held out a whole conversation at a time, then packed."""

    streams = True
    write_synthetic = staticmethod(write_synthetic_task)

    def make_tokenizer(self):
        config = self.config
        texts = lambda: conversation_texts(  # noqa: E731
            load_conversations(
                self.train_sources,
                config.data_format,
                self.cache_dir,
                config.seed,
                text_field=config.dataset_text_field,
            )
        )
        tokenizer = self.trained_tokenizer(fingerprint_sources(self.train_sources), texts, config.max_seq_length)
        return setup_chat_template(tokenizer, config.chat_template, config.trust_remote_code, self.log)

    def tokenise(self, sources: list[DataSource], name: str) -> Tokenised:
        return Tokenised(*_tokenised(self.config, sources, self.tokenizer, self.cache_dir, name, self.built, self.log))

    def split(self, train: Tokenised) -> tuple[Tokenised, Tokenised]:
        kept, held = held_out_split(train.dataset, self.config.eval_split_ratio, self.config.seed)
        self.log.info("Held out %d of the training examples for evaluation (eval_split_ratio)", len(held))
        return train._replace(dataset=kept), Tokenised(held, train.key, {})  # packed under the train data's key

    def finish(self, train: Tokenised, evaluation: Tokenised | None) -> SFTData:
        config, stats = self.config, {**train.stats, **self.notes}
        examples, eval_examples = (_without_conversation_ids(t and t.dataset) for t in (train, evaluation))
        train_rows, eval_rows = examples, eval_examples
        if config.packing:
            part = self.holds_out and "train"
            train_rows, pack_stats = self._packed(examples, train.key, part, "train")
            stats.update(pack_stats)
            if eval_examples is not None:
                eval_rows, _ = self._packed(eval_examples, evaluation.key, self.holds_out and "eval", "eval")
        stats["train_rows"] = len(train_rows)
        stats["train_tokens_per_epoch"] = int(example_lengths(train_rows).sum())
        return SFTData(tokenizer=self.tokenizer, train=train_rows, eval=eval_rows, eval_examples=eval_examples,
                       stats=stats)  # fmt: skip

    def _packed(self, dataset, parent_key: str, part: str | bool, name: str):
        return pack_cached(self.config, dataset, parent_key, part or None, self.cache_dir, name, self.built, self.log)

    def streamed(self) -> SFTData:
        """Streamed train_data: conversations tokenised (and packed) in the loader's workers; eval_data cached as
        usual."""
        config, train_sources = self.config, self.train_sources
        mixture = Mixture(train_sources, "conversation", config.seed, config.mixture_stopping_strategy,
                          data_format=config.data_format, text_field=config.dataset_text_field)  # fmt: skip

        def texts():
            return conversation_texts(
                {"conversation": [r["conversation"] for r in mixture().take(TOKENIZER_EXAMPLES)]}
            )

        # Prepared shards (tunebook prepare --output) come with their tokenizer; anything else names or trains one.
        tokenizer = prepared_tokenizer(train_sources, config, "sft")
        tokenizer = tokenizer or self.trained_tokenizer(
            stream_fingerprint(train_sources), texts, config.max_seq_length
        )
        self.tokenizer = setup_chat_template(tokenizer, config.chat_template, config.trust_remote_code, self.log)
        rows = ChatRows(self.tokenizer, config.max_seq_length, config.overlong_examples, config.assistant_only_loss,
                        config.packing, config.seed, len(train_sources), config.split_turns)  # fmt: skip
        stream = TokenStream(mixture, rows, config.packing_buffer_size, config.per_device_train_batch_size,
                             *process_position(), source_names(train_sources),
                             config.seed if config.stream_shuffle else None)  # fmt: skip
        stream.check_readers(config.dataloader_num_workers, self.log)
        eval_rows = eval_examples = None
        if self.eval_sources:
            evaluation = self.tokenise(self.eval_sources, "eval")
            eval_examples = eval_rows = _without_conversation_ids(evaluation.dataset)
            if config.packing:
                eval_rows, _ = self._packed(eval_examples, evaluation.key, None, "eval")
        stats = {"streamed": True, "sources": source_names(train_sources), **self.notes}
        self.log.info("train data: streamed from %s, tokenised%s as training reads it", ", ".join(stats["sources"]),
                      f" and packed {config.packing_buffer_size} examples at a time" if config.packing else "")  # fmt: skip
        return SFTData(tokenizer=self.tokenizer, train=stream.preview(), eval=eval_rows, eval_examples=eval_examples,
                       stats=stats, stream=stream)  # fmt: skip


# The columns `tokenize_conversations` makes, with the types datasets would infer (input_ids narrowed to int32, as
# datasets does for that name): given, they spare its scan of every value for mixed types (~20% of tokenising).
TOKENISED_FEATURES = datasets.Features({
    "input_ids": datasets.List(datasets.Value("int32")),
    "labels": datasets.List(datasets.Value("int64")),
    "prompt_length": datasets.Value("int64"),
    "truncated": datasets.Value("bool"),
    "keep": datasets.Value("bool"),
})  # fmt: skip
# With split_turns, each example also names its conversation, so eval_split_ratio holds out whole conversations.
TURN_FEATURES = datasets.Features({**TOKENISED_FEATURES, "conversation_id": datasets.Value("int64")})


def _tokenised(config, sources: list[DataSource], tokenizer, cache_dir: Path, name: str, built: list, log):
    args = (config.data_format, config.max_seq_length, config.overlong_examples, config.assistant_only_loss)
    key = sft_cache_key(sources, tokenizer, *args, config.seed, config.dataset_text_field, config.split_turns)
    dataset, stats, cached = prepare_sft_dataset(
        sources,
        tokenizer,
        data_format=config.data_format,
        max_seq_length=config.max_seq_length,
        overlong=config.overlong_examples,
        assistant_only_loss=config.assistant_only_loss,
        cache_dir=cache_dir,
        seed=config.seed,
        num_proc=config.dataset_num_proc,
        key=key,
        text_field=config.dataset_text_field,
        split_turns=config.split_turns,
    )
    if not cached:
        built.append(f"{name} tokenisation")
    how = "loaded from cache, no tokenisation" if cached else "tokenised and cached"
    log.info("%s data: %d examples (%s); %s", name, len(dataset), how, stats)
    if stats["truncated"] or stats["dropped_overlong"] or stats["dropped_no_loss_tokens"]:
        log.warning(
            "%s data: %d truncated and %d dropped at max_seq_length=%d, %d dropped with no loss-bearing token left",
            name,
            stats["truncated"],
            stats["dropped_overlong"],
            config.max_seq_length,
            stats["dropped_no_loss_tokens"],
        )
    return dataset, key, dict(stats)


def _without_conversation_ids(dataset: datasets.Dataset | None) -> datasets.Dataset | None:
    if dataset is None or "conversation_id" not in dataset.column_names:
        return dataset
    return dataset.remove_columns("conversation_id")


def held_out_split(dataset: datasets.Dataset, ratio: float, seed: int):
    """A seeded split of the examples (before any packing), as index views: nothing is copied. Examples that name
    their conversation (split_turns) are held out a whole conversation at a time: no turn of a held-out
    conversation is trained on, and none of its history is."""
    groups = np.asarray(dataset.data.column("conversation_id")) if "conversation_id" in dataset.column_names else None
    ids = np.unique(groups) if groups is not None else np.arange(len(dataset))
    order = np.random.default_rng(seed).permutation(len(ids))
    n_eval = max(1, int(round(ratio * len(ids))))
    if n_eval >= len(ids):
        raise ConfigError(f"eval_split_ratio={ratio} leaves no training examples out of {len(ids)}")
    held = np.isin(groups, ids[order[:n_eval]]) if groups is not None else np.isin(ids, order[:n_eval])
    return dataset.select(np.flatnonzero(~held)), dataset.select(np.flatnonzero(held))


def pack_cached(config, dataset, parent_key: str, part: str | None, cache_dir: Path, name: str, built: list, log,
            carry: tuple[str, ...] = ()):  # fmt: skip
    """`pack_dataset` under the cache; `carry`: more columns packed with the tokens (rows with images: the images)."""
    key = fingerprint(
        {
            "parent": parent_key,
            "split": [config.eval_split_ratio, config.seed, part] if part else None,
            "max_seq_length": config.max_seq_length,
            "seed": config.seed,
            "version": PACKING_VERSION,
            **({"carry": list(carry)} if carry else {}),  # text rows keep the keys they had
        }
    )
    rows, stats, cached = cached_dataset(
        cache_dir,
        key,
        lambda scratch: pack_dataset(
            dataset, config.max_seq_length, config.seed, config.dataset_num_proc, str(scratch / "rows.arrow"), carry
        ),
    )
    if not cached:
        built.append(f"{name} packing")
    log.info(
        "%s data: packed %d examples into %d rows of %d tokens, packing efficiency %.4f (%s)",
        name,
        stats["examples_packed"],
        stats["packed_rows"],
        config.max_seq_length,
        stats["packing_efficiency"],
        "loaded from cache" if cached else "packed and cached",
    )
    return rows, stats


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
    split_turns: bool = False,
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
            **({"split_turns": True} if split_turns else {}),  # absent when off: earlier caches keep their key
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
    split_turns: bool = False,
) -> tuple[datasets.Dataset, dict[str, Any], bool]:
    """Tokenise and mask `sources`, cached by a fingerprint of every input. Returns (dataset, stats, was_cached).

    The dataset has columns `input_ids`, `labels`, `prompt_length`; stats count the examples read, truncated
    and dropped. `key` is `sft_cache_key(...)` of the same arguments, if the caller already computed it.
    """
    args = (data_format, max_seq_length, overlong, assistant_only_loss, seed, text_field, split_turns)
    key = key or sft_cache_key(sources, tokenizer, *args)

    token_chars = longest_token_chars(tokenizer)  # once, not per batch (see cut_overlong)

    def build(scratch: Path) -> tuple[datasets.Dataset, dict[str, Any]]:
        parts, conversations_read = [], 0
        for i, source in enumerate(sources):  # one source at a time, so errors name its file and row
            conversations = _conversations(source, data_format, cache_dir, seed, num_proc, scratch, i, text_field)
            first_id, conversations_read = conversations_read, conversations_read + len(conversations)
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
                        "split_turns": split_turns,
                        "where": source.where,
                        "first_id": first_id if split_turns else None,
                        "token_chars": token_chars,
                    },
                    remove_columns=["conversation"],
                    features=TURN_FEATURES if split_turns else TOKENISED_FEATURES,
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
            **({"conversations_read": conversations_read} if split_turns else {}),
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
