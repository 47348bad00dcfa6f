"""Pack tokenised examples into rows of `max_seq_length` without letting them attend to each other.

Rows are filled by best-fit decreasing: examples are taken longest first (ties in a seeded random order) and each
goes into the open row it fills most tightly. On SFT data this wastes a few percent of a row where padding to the
longest example of a batch wastes a third or more.

Rows stay `max_seq_length` long instead of flattening a whole batch into one row: without a varlen kernel
attention costs grow with the square of the row length. A packed row keeps the length of every example
(`seq_lengths`), from which the collator derives position ids that restart at each example and segment ids, and
`tunebook.models.attention` builds from them, per attention backend, what keeps attention inside each example.
"""

from __future__ import annotations

from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.table import InMemoryTable

from .. import compat
from .tokenize import IGNORE_INDEX

__all__ = ["best_fit_decreasing", "concatenate_examples", "example_lengths", "pack_dataset"]


def example_lengths(dataset: datasets.Dataset, column: str = "input_ids") -> np.ndarray:
    """Token count of every row, read from the Arrow column without materialising the rows in Python."""
    lengths = np.asarray(pc.list_value_length(dataset.data.column(column)), dtype=np.int64)
    # A `select`ed view (e.g. a train/eval split) maps rows to the underlying table.
    indices = compat.indices_mapping(dataset)
    if indices is not None:
        lengths = lengths[np.asarray(indices.column(0), dtype=np.int64)]
    return lengths


def best_fit_decreasing(lengths: np.ndarray, capacity: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Assign items to bins of `capacity`; returns (item order, bin offsets) in CSR form.

    Bin b holds items `order[offsets[b]:offsets[b + 1]]`. Deterministic for a seed. Runs in
    O(n * capacity / SIMD width): the open bins are bucketed by remaining space, so finding the tightest bin
    that fits is one vectorised scan of `capacity` flags per item.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.max() > capacity or lengths.min() < 1):
        raise ValueError(f"every length must be in [1, {capacity}]")
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.permutation(len(lengths)), -lengths))  # longest first, ties shuffled by the seed
    has_room = np.zeros(capacity + 1, dtype=bool)  # has_room[r]: some open bin has exactly r tokens free
    bins_by_room: list[list[int]] = [[] for _ in range(capacity + 1)]
    room: list[int] = []
    bin_of = np.empty(len(lengths), dtype=np.int64)
    for item in order:
        size = int(lengths[item])
        j = int(has_room[size:].argmax())
        if has_room[size + j]:
            r = size + j
            b = bins_by_room[r].pop()
            if not bins_by_room[r]:
                has_room[r] = False
        else:
            b, r = len(room), capacity
            room.append(capacity)
        bin_of[item] = b
        room[b] = r - size
        bins_by_room[r - size].append(b)
        has_room[r - size] = True
    # Items grouped by bin, in the order they were placed (stable sort keeps the longest-first order).
    placed = order[np.argsort(bin_of[order], kind="stable")]
    counts = np.bincount(bin_of, minlength=len(room))
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return placed, offsets


def concatenate_examples(ids: list[list[int]], labels: list[list[int]]) -> dict[str, list]:
    """One packed row: the examples' tokens and labels end to end, with each example's length (`seq_lengths`)."""
    row: dict[str, list] = {"input_ids": [], "labels": [], "seq_lengths": []}
    for ex_ids, ex_labels in zip(ids, labels):
        ex_labels = list(ex_labels)
        # The first token of an example is never predicted (on its own nothing precedes it), so the previous
        # example's last token must not learn to predict it either.
        ex_labels[0] = IGNORE_INDEX
        row["input_ids"].extend(ex_ids)
        row["labels"].extend(ex_labels)
        row["seq_lengths"].append(len(ex_ids))
    return row


def _gather_rows(batch: dict[str, list], source: datasets.Dataset, carry: tuple[str, ...] = ()) -> dict[str, list]:
    """Batched `map` over bins: concatenate each bin's examples into one row, and the `carry` columns with them: a
    list column end to end, with its count per example as `{column}_per_example`; a string column joined by "; "."""
    bins = batch["indices"]
    examples = source[[i for b in bins for i in b]]
    out: dict[str, list] = {"input_ids": [], "labels": [], "seq_lengths": []}
    k = 0
    for b in bins:
        row = concatenate_examples(examples["input_ids"][k : k + len(b)], examples["labels"][k : k + len(b)])
        for column in carry:
            values = examples[column][k : k + len(b)]
            if isinstance(values[0], str):
                row[column] = "; ".join(values)
            else:
                row[column] = [v for value in values for v in value]
                row[f"{column}_per_example"] = [len(value) for value in values]
        k += len(b)
        for key, value in row.items():
            out.setdefault(key, []).append(value)
    return out


def pack_dataset(
    dataset: datasets.Dataset,
    max_seq_length: int,
    seed: int,
    num_proc: int | None = None,
    cache_file_name: str | None = None,
    carry: tuple[str, ...] = (),
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """Pack `input_ids`/`labels` rows into rows of at most `max_seq_length` tokens.

    Returns the packed dataset (columns `input_ids`, `labels`, `seq_lengths`) and stats: examples, rows, and
    `packing_efficiency`, the share of the rows' `max_seq_length` slots that hold real tokens. Give
    `cache_file_name` to write the rows to an Arrow file as they are made instead of holding them in memory.
    `carry` names more columns packed with the tokens, in the examples' order (`_gather_rows`): rows with images
    keep their images in the order of their placeholders, and how many belong to each example.
    """
    lengths = example_lengths(dataset)
    order, offsets = best_fit_decreasing(lengths, max_seq_length, seed)
    # The bin table is built from numpy through Arrow, never as Python lists of every index.
    bins = pa.ListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(order, pa.int64()))
    table = datasets.Dataset(InMemoryTable(pa.table({"indices": bins})))
    packed = table.map(
        _gather_rows,
        batched=True,
        batch_size=256,
        fn_kwargs={"source": dataset.select_columns(["input_ids", "labels", *carry]), "carry": tuple(carry)},
        remove_columns=["indices"],
        num_proc=num_proc,
        desc="Packing",
        cache_file_name=cache_file_name,
        new_fingerprint=f"tunebook-pack-{compat.fingerprint(dataset)}-{max_seq_length}-{seed}{''.join('-' + c for c in carry)}",
    )
    rows = len(offsets) - 1
    stats = {
        "examples_packed": len(lengths),
        "packed_rows": rows,
        "packing_efficiency": float(lengths.sum() / (rows * max_seq_length)) if rows else 0.0,
    }
    return packed, stats
