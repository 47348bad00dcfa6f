"""Streamed sources opened as one stream: each source read shard by shard (a Hugging Face `IterableDataset`), tagged
with its index and interleaved with the others by weight; how a run decides it streams, and what a tokenizer trained on
streamed sources is cached by."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from ...errors import DataError, first_line
from ..formats import detect_format, to_conversations
from ..sources import DataSource, _load, _quiet_datasets, _resolve
from .prepared import ROW_COLUMNS, prepared_meta

__all__ = ["Mixture", "is_streamed", "source_names", "stream_fingerprint"]


def is_streamed(sources: list[DataSource], key: str = "train_data") -> bool:
    """Whether `sources` are streamed; a mixture of streamed and cached sources is refused."""
    streamed = {s.streaming for s in sources}
    if len(streamed) > 1:
        raise DataError(f"{key}: stream every source or none (streaming: true on some of them only)")
    return streamed == {True}


def stream_fingerprint(sources: list[DataSource], text_sample_by: str = "paragraph") -> str:
    """What a tokenizer trained on streamed sources is cached by: the sources and their files' names, sizes and
    modification times (hashing the contents, as cached sources are, would read the whole corpus once more)."""
    h = hashlib.sha256()
    for source in sources:
        h.update(f"{source!r}|{source.weight}".encode())
        resolved = _resolve(source, text_sample_by)
        h.update(str(resolved.builder.hash if resolved.kind == "hub" else "").encode())
        for path in resolved.files:
            stat = Path(path).stat()
            h.update(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return h.hexdigest()


def _open_source(source: DataSource, text_sample_by: str) -> datasets.IterableDataset:
    resolved = _resolve(source, text_sample_by)
    if resolved.split and "[" in resolved.split:
        raise DataError(f"{source.where}: a streamed split cannot be sliced ({resolved.split}); remove the slice")
    with _quiet_datasets():
        stream = _load(source, resolved, streaming=True)
    if isinstance(stream, datasets.Dataset):  # a save_to_disk folder: its Arrow files are the shards
        stream = stream.to_iterable_dataset(num_shards=max(sum(f.suffix == ".arrow" for f in resolved.files), 1))
    return stream.rename_columns(source.renames) if source.renames else stream


def _first_row(stream: datasets.IterableDataset, source: DataSource) -> dict[str, Any]:
    try:
        row = next(iter(stream.take(1)), None)
    except Exception as error:  # a parser error of the first rows, with datasets' long wrapping cut to one line
        raise DataError(f"could not read {source.where}: {first_line(error)}") from None
    if row is None:
        raise DataError(f"{source.where}: no rows")
    return row


def _tag(batch: dict[str, list], index: int) -> dict[str, list]:
    return {"source": [index] * len(next(iter(batch.values())))}


class Mixture:
    """Opens the streamed sources as one `IterableDataset` of `column` and `source` (the index of the source each row
    came from): interleaved with probabilities from their weights and `seed`, or the one source. A class, not a
    closure, so loader workers started by spawn can pickle it.

    With `data_format` (sft), every source's rows are first converted to `conversation` JSON (`column` is then
    "conversation"). Each source's first row is read here, so a missing column stops with one line before training.
    """

    def __init__(self, sources: list[DataSource], column: str, seed: int, stopping_strategy: str,
                 text_sample_by: str = "paragraph", data_format: str | None = None, text_field: str = "text"):  # fmt: skip
        self.sources, self.column, self.seed, self.stopping_strategy = sources, column, seed, stopping_strategy
        self.text_sample_by, self.text_field = text_sample_by, text_field
        self.formats, self.columns = [], []
        self.prepared = {prepared_meta(s) is not None for s in sources} == {True}
        if not self.prepared and any(prepared_meta(s) for s in sources):
            raise DataError(
                "train_data: mix prepared shards (tunebook prepare --output) only with other prepared shards"
            )
        for source in sources:
            row = _first_row(_open_source(source, text_sample_by), source)
            if self.prepared:
                self.formats.append(None)
                self.columns.append([c for c in ROW_COLUMNS if c in row])
                continue
            if data_format is None and column not in row:
                raise DataError(f"{source.where}: no column {column!r} (columns: {', '.join(row)}); set text_column")
            self.formats.append(data_format and detect_format(list(row), data_format, source.where, text_field))
            self.columns.append(list(row))

    def __call__(self) -> datasets.IterableDataset:
        streams = []
        for index, (source, fmt) in enumerate(zip(self.sources, self.formats)):
            stream = _open_source(source, self.text_sample_by)
            if self.prepared:  # tokenised (and packed) by tunebook prepare: the rows as they are
                stream = stream.select_columns(self.columns[index])
            elif fmt:
                kwargs = {"data_format": fmt, "where": source.where, "text_field": self.text_field}
                stream = stream.map(to_conversations, batched=True, with_indices=True,
                                    remove_columns=self.columns[index], fn_kwargs=kwargs)  # fmt: skip
            else:
                stream = stream.select_columns([self.column])
            streams.append(stream.map(_tag, batched=True, fn_kwargs={"index": index}))
        if len(streams) == 1:
            return streams[0]
        weights = np.array([s.weight for s in self.sources], dtype=np.float64)
        return datasets.interleave_datasets(streams, probabilities=(weights / weights.sum()).tolist(), seed=self.seed,
                                            stopping_strategy=self.stopping_strategy)  # fmt: skip


def source_names(sources: list[DataSource]) -> list[str]:
    """How the logs and summary name each source: its file or folder name, its path when names repeat."""
    names = [Path(s.path).name or s.path for s in sources]
    return [s.path if names.count(n) > 1 else n for s, n in zip(sources, names)]
