"""The one skeleton of every recipe's data preparation: sources -> tokenizer -> tokenised into the cache (train, then
eval) -> a held-out split when there is no eval data -> the prepared data with its stats.

A task (`sft`, `classification`, `text`, `preference`, `prompts`) subclasses `Pipeline` with its steps only: how it
gets its tokenizer, how it tokenises one split (its cache key and build), how it holds out eval data, what it hands
the recipe (`finish`), and, where train data may stream, how it streams. What is hashed into each cache key stays
the task's own, so `tunebook prepare` and a training run with the same config find the same caches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import datasets
from transformers import PreTrainedTokenizerBase

from ..models.tokenizer import config_tokenizer
from .cache import cached_dataset
from .sources import DataSource, config_sources
from .stream import is_streamed

__all__ = ["Pipeline", "PreparedData", "Tokenised"]


@dataclass(kw_only=True)
class PreparedData:
    """The prepared data of a run, what every task's has; a task's subclass adds its own fields."""

    tokenizer: PreTrainedTokenizerBase
    train: datasets.Dataset  # what the train loader reads (with streaming: the first rows, for the log)
    eval: datasets.Dataset | None  # what the eval loader reads
    stats: dict[str, Any] = field(default_factory=dict)  # of the training data
    built: list[str] = field(default_factory=list)  # what had to be built (empty: everything came from the cache)
    seconds: float = 0.0
    # With streaming: true, the rows are made as training reads them (`train` then holds the first few, for the log).
    stream: Any = None
    # A vision-language model's processor (its tokenizer is `tokenizer`): saved with the model in the tokenizer's place.
    processor: Any = None


class Tokenised(NamedTuple):
    """One tokenised split: the data set, the cache key it is stored under, and its stats."""

    dataset: datasets.Dataset
    key: str
    stats: dict[str, Any]


class Pipeline:
    """One run's data preparation (`prepare`); a task's subclass gives the steps. Call it through
    `tunebook.distributed.prepare_then_join` in multi-process runs: the first process builds the caches, the others
    find them finished."""

    streams = False  # whether train data may stream (the subclass then has `streamed`)

    def __init__(self, config, cache_dir: Path, log: logging.Logger):
        self.config, self.cache_dir, self.log = config, cache_dir, log
        self.built: list[str] = []
        self.notes: dict[str, Any] = {}  # what tokenizer training left out
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.train_sources: list[DataSource] = []
        self.eval_sources: list[DataSource] = []

    def prepare(self) -> PreparedData:
        start = time.perf_counter()
        # No train_data: the embedded default's generated task.
        self.train_sources, self.eval_sources = config_sources(self.config, self.cache_dir, self.write_synthetic)
        if self.streams and is_streamed(self.train_sources):
            data = self.streamed()
        else:
            self.tokenizer = self.make_tokenizer()
            train = self.tokenise(self.train_sources, "train")
            evaluation = self.tokenise(self.eval_sources, "eval") if self.eval_sources else None
            if evaluation is None and self.holds_out:
                train, evaluation = self.split(train)
            data = self.finish(train, evaluation)
        data.built, data.seconds = self.built, time.perf_counter() - start
        return data

    @property
    def holds_out(self) -> bool:
        """Whether eval data is held out of the train data (`eval_split_ratio`, no eval data)."""
        return not self.eval_sources and self.config.eval_split_ratio > 0

    # --- the steps a task gives

    def write_synthetic(self, directory: Path, num_train: int, num_eval: int, seed: int):
        """Write the task's generated default data; return the (train, eval) paths."""
        raise NotImplementedError

    def make_tokenizer(self) -> PreTrainedTokenizerBase:
        raise NotImplementedError

    def tokenise(self, sources: list[DataSource], name: str) -> Tokenised:
        """`sources` tokenised into the cache (`cached`); `name` is train or eval."""
        raise NotImplementedError

    def split(self, train: Tokenised) -> tuple[Tokenised, Tokenised]:
        """(train, eval) held out of the tokenised train data."""
        raise NotImplementedError

    def finish(self, train: Tokenised, evaluation: Tokenised | None) -> PreparedData:
        raise NotImplementedError

    def streamed(self) -> PreparedData:
        raise NotImplementedError

    # --- what the steps share

    def trained_tokenizer(self, data_key: str, texts: Callable, max_tokens: int, **kwargs) -> PreTrainedTokenizerBase:
        """The config's tokenizer, or one trained on `texts()` (cached by `data_key`, see `config_tokenizer`)."""
        return config_tokenizer(self.config, self.cache_dir, data_key, texts, self.built, self.log,
                                max_tokens=max_tokens, stats=self.notes, **kwargs)  # fmt: skip

    def cached(self, key: str, build: Callable, what: str) -> tuple[datasets.Dataset, dict[str, Any], bool]:
        """The cache's entry `key`, or `build(scratch)`'s, saved (`cached_dataset`); `what` goes into `built`."""
        dataset, stats, cached = cached_dataset(self.cache_dir, key, build)
        if not cached:
            self.built.append(what)
        return dataset, stats, cached
