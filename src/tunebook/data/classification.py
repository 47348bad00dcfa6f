"""Text (or text-pair) classification data: sources -> label ids -> tokenised, cached `datasets.Dataset`s.

Labels may be strings or integers in a configurable column. Their names (`label_names`, or the sorted distinct
strings of the training data, or `0..K-1` for integer labels) become the model's `id2label`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import ConfigError, DataError
from .cache import PREPROCESSING_VERSION, fingerprint, tokenizer_fingerprint
from .pipeline import Pipeline, PreparedData, Tokenised
from .sources import DataSource, fingerprint_sources, load_source, raise_unless_text
from .synthetic import write_synthetic_classification
from .tokenize import cut_overlong, longest_token_chars

__all__ = ["ClassificationData", "ClassificationPipeline", "label_names_of", "prepare_classification_data"]


@dataclass(kw_only=True)
class ClassificationData(PreparedData):
    """The prepared data of a classification run: rows of input_ids (token_type_ids) and labels."""

    label_names: list[str]


def prepare_classification_data(config, cache_dir: Path, log: logging.Logger) -> ClassificationData:
    """`config` is a `ClassifyConfig`. In multi-process runs call it through `tunebook.distributed.prepare_then_join`."""
    return ClassificationPipeline(config, cache_dir, log).prepare()


class ClassificationPipeline(Pipeline):
    """Classification's steps: the train data is read first (its labels name the classes, its texts train the
    tokenizer), then each split tokenised with label ids; a seeded held-out split of examples."""

    write_synthetic = staticmethod(write_synthetic_classification)
    # Read with the train data, before the tokenizer: the text, text pair and label columns, the train rows, and the
    # class names (`label_names`, else the train labels').
    columns: list[str]
    train_raw: datasets.Dataset
    label_names: list[str]

    def make_tokenizer(self):
        config = self.config
        self.columns = [c for c in (config.text_column, config.text_pair_column, config.label_column) if c]
        self.train_raw = _load(self.train_sources, self.columns, self.cache_dir, config.seed)
        self.label_names = config.label_names or label_names_of(self.train_raw.data.column(config.label_column))
        texts = lambda: (t for c in self.columns[:-1] for t in self.train_raw[c])  # noqa: E731
        key = fingerprint_sources(self.train_sources) + "|" + "|".join(self.columns)
        tokenizer = self.trained_tokenizer(key, texts, config.max_seq_length, kind="encoder")
        # Batches pad on the right whatever the tokenizer ships (chat tokenizers pad left): models with absolute
        # positions (BERT, GPT-2) count them from the row's start, so left padding would shift every shorter
        # example's positions. Every sequence-classification head pools right-padded rows correctly.
        tokenizer.padding_side = "right"
        return tokenizer

    def tokenise(self, sources: list[DataSource], name: str) -> Tokenised:
        config, tokenizer, columns, label_names = self.config, self.tokenizer, self.columns, self.label_names
        raw = self.train_raw if name == "train" else None
        key = fingerprint(
            {
                "sources": fingerprint_sources(sources),
                "tokenizer": tokenizer_fingerprint(tokenizer),
                "columns": columns,
                "labels": label_names,
                "max_seq_length": config.max_seq_length,
                "seed": config.seed if any(s.weight != 1.0 or s.samples is not None for s in sources) else None,
                "version": f"classification-{PREPROCESSING_VERSION}",
            }
        )

        def build(scratch: Path):
            table = raw if raw is not None else _load(sources, columns, self.cache_dir, config.seed)
            where = ", ".join(s.where for s in sources)
            dataset = table.map(
                _tokenize,
                batched=True,
                with_indices=True,
                fn_kwargs={
                    "tokenizer": tokenizer,
                    "config": config,
                    "label_names": label_names,
                    "where": where,
                    "token_chars": longest_token_chars(tokenizer),
                },
                remove_columns=table.column_names,
                num_proc=config.dataset_num_proc,
                cache_file_name=str(scratch / "tokenised.arrow"),
                desc=f"Tokenising {name}",
            )
            lengths = np.asarray(pc.list_value_length(dataset.data.column("input_ids")))
            return dataset, {
                "examples": len(dataset),
                "at_max_seq_length": int((lengths >= config.max_seq_length).sum()),
            }

        dataset, stats, cached = self.cached(key, build, f"{name} tokenisation")
        self.log.info(
            "%s data: %d examples (%s)", name, len(dataset), "from cache" if cached else "tokenised and cached"
        )
        return Tokenised(dataset, key, stats)

    def split(self, train: Tokenised) -> tuple[Tokenised, Tokenised]:
        ratio, dataset = self.config.eval_split_ratio, train.dataset
        order = np.random.default_rng(self.config.seed).permutation(len(dataset))
        n_eval = max(1, int(round(ratio * len(dataset))))
        if n_eval >= len(dataset):
            raise ConfigError(f"eval_split_ratio={ratio} leaves no training examples")
        held = dataset.select(np.sort(order[:n_eval]))
        return train._replace(dataset=dataset.select(np.sort(order[n_eval:]))), Tokenised(held, train.key, {})

    def finish(self, train: Tokenised, evaluation: Tokenised | None) -> ClassificationData:
        stats = train.stats
        counts = np.bincount(np.asarray(train.dataset.data.column("labels")), minlength=len(self.label_names))
        stats["label_counts"] = dict(zip(self.label_names, counts.tolist()))
        stats.update(self.notes)
        return ClassificationData(tokenizer=self.tokenizer, train=train.dataset,
                                  eval=evaluation and evaluation.dataset, label_names=self.label_names, stats=stats)  # fmt: skip


def label_names_of(column: pa.ChunkedArray) -> list[str]:
    """Class names from a label column: its distinct strings sorted, or `0..max` for integer labels."""
    if pa.types.is_integer(column.type) or pa.types.is_boolean(column.type):
        values = pc.cast(column, pa.int64())
        low, high = pc.min(values).as_py(), pc.max(values).as_py()
        if low is None or low < 0:
            raise DataError(f"integer labels must be >= 0 (found {low}); or give label_names")
        return [str(i) for i in range(high + 1)]
    return sorted(str(v) for v in pc.unique(column.drop_null()).to_pylist())


def _load(sources: list[DataSource], columns: list[str], cache_dir: Path, seed: int) -> datasets.Dataset:
    parts = []
    for source in sources:
        raw = load_source(source, cache_dir, seed)
        missing = [c for c in columns if c not in raw.column_names]
        if missing:
            raise DataError(
                f"{source.where}: missing column(s) {', '.join(missing)} (columns: {', '.join(raw.column_names)}); "
                "set text_column, text_pair_column and label_column"
            )
        raw = raw.select_columns(columns)
        for column in columns[:-1]:
            raise_unless_text(raw, column, source.where)
        _raise_if_labels_mix_types(raw, columns[-1], source.where)
        parts.append(_integer_labels(raw, columns[-1], source.where))
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def _raise_if_labels_mix_types(dataset: datasets.Dataset, column: str, where: str) -> None:
    """Labels are all class names or all class ids: a number among names (which the JSON reader keeps as written)
    fails at the first row whose kind differs from the first label's."""
    if not isinstance(dataset.features[column], datasets.Json):  # one Arrow type: names, or ids
        return
    values = dataset[column]
    first = next((i for i, v in enumerate(values) if v is not None), 0)
    row = next((i for i, v in enumerate(values) if v is not None and _kind(v) != _kind(values[first])), None)
    if row is None:
        return
    raise DataError(f"{where}, row {row + 1}: label {values[row]!r:.100} in column {column!r} is {_kind(values[row])} "
                    f"where row {first + 1} has {_kind(values[first])} ({values[first]!r:.100}); labels must be all "
                    "class names or all class ids")  # fmt: skip


def _kind(value) -> str:
    if isinstance(value, str):
        return "a name"
    if isinstance(value, bool):
        return "a boolean"
    return "a number" if isinstance(value, int | float) else f"a {type(value).__name__}"


def _integer_labels(dataset: datasets.Dataset, label_column: str, where: str) -> datasets.Dataset:
    """CSV/TSV cells are read as text (see `sources`): a label column of whole numbers is class ids, as in JSON.
    So are floats that are whole numbers (0.0/1.0, as pandas writes a column that once held a NaN)."""
    column = dataset.data.column(label_column)
    if pa.types.is_floating(column.type):
        values = column.drop_null()
        if not pc.all(pc.equal(values, pc.floor(values))).as_py():
            row = next(i for i, v in enumerate(column.to_pylist()) if v is not None and (v != v or v != int(v)))
            raise DataError(f"{where}, row {row + 1}: label {column[row].as_py()} in column {label_column!r} is not a whole "
                            "number; classification needs class labels (names, or ids 0..K-1)")  # fmt: skip
        return dataset.cast_column(label_column, datasets.Value("int64"))
    if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
        return dataset
    if not pc.all(pc.match_substring_regex(column, r"^\d+$")).as_py():
        return dataset
    return dataset.cast_column(label_column, datasets.Value("int64"))


def _tokenize(
    batch, indices, *, tokenizer, config, label_names: list[str], where: str, token_chars: int
) -> dict[str, list]:
    label_ids = {name: i for i, name in enumerate(label_names)}
    labels = []
    for index, value in zip(indices, batch[config.label_column]):
        # A string is a class name; an integer indexes label_names (or is the class id itself, named "0".."K-1").
        if isinstance(value, str):
            label = label_ids.get(value)
        elif isinstance(value, int):
            label = int(value) if 0 <= value < len(label_names) else None
        else:
            label = None
        if label is None:
            raise DataError(
                f"{where}, row {index + 1}: label {value!r} in column {config.label_column!r} is not one of "
                f"{label_names} (set label_names to list every class)"
            )
        labels.append(label)
    for column in (config.text_column, config.text_pair_column):
        if column and any(not isinstance(t, str) for t in batch[column]):
            row = next(i for i, t in zip(indices, batch[column]) if not isinstance(t, str))
            raise DataError(f"{where}, row {row + 1}: column {column!r} must hold text")
    pair = batch[config.text_pair_column] if config.text_pair_column else None
    texts = batch[config.text_column]
    if pair is None:  # a text too long to fit is tokenised from its head (pairs are cut by their relative lengths)
        texts = cut_overlong(tokenizer, texts, config.max_seq_length, token_chars)
    encoded = tokenizer(texts, pair, truncation=True, max_length=config.max_seq_length)
    out = {"input_ids": encoded["input_ids"], "labels": labels}
    if "token_type_ids" in encoded:
        out["token_type_ids"] = encoded["token_type_ids"]
    return out
