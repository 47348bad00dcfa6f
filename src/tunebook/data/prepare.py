"""Everything between a recipe's config and its data loaders: sources, tokenizer, tokenised and packed caches.

`prepare_sft_data` is what both `recipes/sft.py` and `tunebook prepare` call, so preparing ahead of time builds
exactly the caches a training run with the same config looks up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from ..errors import ConfigError
from .cache import cached_dataset, fingerprint
from .packing import example_lengths, pack_dataset
from .pipeline import conversation_texts, load_conversations, prepare_sft_dataset, sft_cache_key
from .sources import DataSource, config_sources, fingerprint_sources
from .synthetic import write_synthetic_task
from .tokenizer import config_tokenizer, setup_chat_template

__all__ = ["SFTData", "prepare_sft_data"]

PACKING_VERSION = "1"  # bump when packing changes what it produces


@dataclass
class SFTData:
    """The prepared data of an SFT run."""

    tokenizer: PreTrainedTokenizerBase
    train: datasets.Dataset  # what the train loader reads: packed rows, or tokenised examples
    eval: datasets.Dataset | None  # what the eval-loss loader reads (packed rows when packing)
    eval_examples: datasets.Dataset | None  # unpacked eval examples, for generation eval
    stats: dict[str, Any] = field(default_factory=dict)  # of the training data
    built: list[str] = field(default_factory=list)  # what had to be built (empty: everything came from the cache)
    seconds: float = 0.0


def prepare_sft_data(config, cache_dir: Path, log: logging.Logger) -> SFTData:
    """Sources -> tokenizer -> tokenised (and packed) train and eval sets, each from the cache when unchanged.

    `config` is an `SFTConfig`. In multi-process runs call it through
    `tunebook.distributed.prepare_then_join`: the first process builds the caches, the others find them finished.
    """
    start = time.perf_counter()
    built: list[str] = []
    # No train_data: the embedded default's generated task.
    train_sources, eval_sources = config_sources(config, cache_dir, write_synthetic_task)

    texts = lambda: conversation_texts(  # noqa: E731
        load_conversations(
            train_sources, config.data_format, cache_dir, config.seed, text_field=config.dataset_text_field
        )
    )
    tokenizer = config_tokenizer(config, cache_dir, fingerprint_sources(train_sources), texts, built, log)
    tokenizer = setup_chat_template(tokenizer, config.chat_template, config.trust_remote_code, log)

    train, train_key, stats = _tokenised(config, train_sources, tokenizer, cache_dir, "train", built, log)
    eval_examples, eval_key = None, None
    if eval_sources:
        eval_examples, eval_key, _ = _tokenised(config, eval_sources, tokenizer, cache_dir, "eval", built, log)
    split = None
    if eval_examples is None and config.eval_split_ratio > 0:
        train, eval_examples, split = _split(train, config.eval_split_ratio, config.seed)
        eval_key = train_key
        log.info("Held out %d of the training examples for evaluation (eval_split_ratio)", len(eval_examples))

    train_rows, eval_rows = train, eval_examples
    if config.packing:
        train_rows, pack_stats = _packed(config, train, train_key, split and "train", cache_dir, "train", built, log)
        stats.update(pack_stats)
        if eval_examples is not None:
            eval_rows, _ = _packed(config, eval_examples, eval_key, split and "eval", cache_dir, "eval", built, log)
    stats["train_rows"] = len(train_rows)
    stats["train_tokens_per_epoch"] = int(example_lengths(train_rows).sum())
    return SFTData(tokenizer, train_rows, eval_rows, eval_examples, stats, built, time.perf_counter() - start)


def _tokenised(config, sources: list[DataSource], tokenizer, cache_dir: Path, name: str, built: list, log):
    args = (config.data_format, config.max_seq_length, config.overlong_examples, config.assistant_only_loss)
    key = sft_cache_key(sources, tokenizer, *args, config.seed, config.dataset_text_field)
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


def _split(dataset: datasets.Dataset, ratio: float, seed: int):
    """A seeded split of the examples (before any packing), as index views: nothing is copied."""
    order = np.random.default_rng(seed).permutation(len(dataset))
    n_eval = max(1, int(round(ratio * len(dataset))))
    if n_eval >= len(dataset):
        raise ConfigError(f"eval_split_ratio={ratio} leaves no training examples out of {len(dataset)}")
    return dataset.select(np.sort(order[n_eval:])), dataset.select(np.sort(order[:n_eval])), (ratio, seed)


def _packed(config, dataset, parent_key: str, part: str | None, cache_dir: Path, name: str, built: list, log):
    key = fingerprint(
        {
            "parent": parent_key,
            "split": [config.eval_split_ratio, config.seed, part] if part else None,
            "max_seq_length": config.max_seq_length,
            "seed": config.seed,
            "version": PACKING_VERSION,
        }
    )
    rows, stats, cached = cached_dataset(
        cache_dir,
        key,
        lambda scratch: pack_dataset(
            dataset, config.max_seq_length, config.seed, config.dataset_num_proc, str(scratch / "rows.arrow")
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
