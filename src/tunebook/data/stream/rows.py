"""Groups of streamed rows -> training rows, and a reader's rows with its position after each.

A reader takes `group` rows at a time and turns each group into training rows (pretrain: `TextRows`, documents cut
into rows of `max_seq_length`, the unfinished row carried into the next group; sft: `ChatRows`, examples, or rows
packed best-fit within the group). `reader_rows` loops over epochs itself and yields each row with the position a
resumed reader continues from: the group's start, the carry into it, and how many of its rows were delivered.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
from datasets.distributed import split_dataset_by_node

from ...errors import DataError
from ..packing import best_fit_decreasing, concatenate_examples
from ..tokenize import longest_token_chars, tokenize_conversations
from .prepared import ROW_COLUMNS

__all__ = ["ChatRows", "TextRows", "reader_rows"]


class TextRows:
    """Pretrain: documents + EOS concatenated and cut into rows of `max_seq_length`, as `chunk_documents` cuts the
    cached corpus; the unfinished row's pieces (tokens, source) are the carry into the next group."""

    column = "text"

    def __init__(self, tokenizer, max_seq_length: int, text_column: str, num_sources: int):
        self.tokenizer, self.length, self.column, self.num_sources = (
            tokenizer,
            max_seq_length,
            text_column,
            num_sources,
        )

    def __call__(self, batch: dict[str, list], carry) -> tuple[list[dict], Any]:
        if "input_ids" in batch:
            return _prepared_rows(batch, self.num_sources), carry
        docs = self.tokenizer(batch[self.column], add_special_tokens=False)["input_ids"]
        pieces = [tuple(p) for p in carry or []]
        filled = sum(len(ids) for ids, _ in pieces)
        rows = []
        for doc, source in zip(docs, batch["source"]):
            doc, pos = doc + [self.tokenizer.eos_token_id], 0
            while pos < len(doc):
                take = min(len(doc) - pos, self.length - filled)
                pieces.append((doc[pos : pos + take], source))
                pos, filled = pos + take, filled + take
                if filled == self.length:
                    rows.append(self._row(pieces))
                    pieces, filled = [], 0
        return rows, pieces

    def _row(self, pieces: list[tuple[list[int], int]]) -> dict[str, list]:
        # labels = ids: every token but a piece's first carries the loss (nothing of its document precedes it)
        row = concatenate_examples([ids for ids, _ in pieces], [ids for ids, _ in pieces])
        row["source_tokens"] = _per_source(row["seq_lengths"], [s for _, s in pieces], self.num_sources)
        return row


class ChatRows:
    """SFT: conversations tokenised and loss-masked as the cached path does; with `packing`, a group's examples
    packed best-fit decreasing (`packing_buffer_size` examples per group) as `pack_dataset` packs a whole data set."""

    column = "conversation"

    def __init__(self, tokenizer, max_seq_length: int, overlong: str, assistant_only_loss: bool, packing: bool,
                 seed: int, num_sources: int, split_turns: bool = False):  # fmt: skip
        self.split_turns = split_turns
        self.tokenizer, self.length, self.overlong = tokenizer, max_seq_length, overlong
        self.token_chars = longest_token_chars(tokenizer)  # once, not per group (see cut_overlong)
        self.assistant_only_loss, self.packing, self.seed, self.num_sources = (
            assistant_only_loss,
            packing,
            seed,
            num_sources,
        )

    def __call__(self, batch: dict[str, list], carry) -> tuple[list[dict], Any]:
        if "input_ids" in batch:
            return _prepared_rows(batch, self.num_sources), carry
        origin: list[int] = []  # the conversation each example came from (several with split_turns)
        out = tokenize_conversations({"conversation": batch["conversation"]}, tokenizer=self.tokenizer,
                                     max_seq_length=self.length, overlong=self.overlong,
                                     assistant_only_loss=self.assistant_only_loss, split_turns=self.split_turns,
                                     where="streamed train_data", origin=origin,
                                     token_chars=self.token_chars)  # fmt: skip
        kept = [i for i, keep in enumerate(out["keep"]) if keep]
        ids, labels = [out["input_ids"][i] for i in kept], [out["labels"][i] for i in kept]
        sources = [batch["source"][origin[i]] for i in kept]
        if not self.packing:
            rows = [{"input_ids": x, "labels": y, "source_tokens": _per_source([len(x)], [s], self.num_sources)}
                    for x, y, s in zip(ids, labels, sources)]  # fmt: skip
        else:
            lengths = np.array([len(i) for i in ids], dtype=np.int64)
            order, offsets = best_fit_decreasing(lengths, self.length, self.seed)
            rows = []
            for b in range(len(offsets) - 1):
                members = order[offsets[b] : offsets[b + 1]]
                row = concatenate_examples([ids[m] for m in members], [labels[m] for m in members])
                row["source_tokens"] = _per_source(row["seq_lengths"], [sources[m] for m in members], self.num_sources)
                rows.append(row)
        if rows:  # the group's examples are counted once, with one of its rows: when that row is trained on
            rows[0]["examples"] = _example_counts(out, self.overlong)
        return rows, None


def _example_counts(out: dict[str, list], overlong: str) -> list[int]:
    """[read, truncated, dropped as too long, dropped with no loss-bearing token] (the cached path's stats)."""
    truncated = sum(out["truncated"]) if overlong == "truncate" else 0
    too_long = sum(t and not k for t, k in zip(out["truncated"], out["keep"])) if overlong == "drop" else 0
    return [len(out["keep"]), truncated, too_long, sum(not k for k in out["keep"]) - too_long]


def _prepared_rows(batch: dict[str, list], num_sources: int) -> list[dict]:
    columns = [c for c in ROW_COLUMNS if c in batch]
    rows = [dict(zip(columns, values)) for values in zip(*(batch[c] for c in columns))]
    for row, source in zip(rows, batch["source"]):
        row["source_tokens"] = _per_source([len(row["input_ids"])], [source], num_sources)
    return rows


def _per_source(lengths: list[int], sources: list[int], num_sources: int) -> list[int]:
    counts = [0] * num_sources
    for n, s in zip(lengths, sources):
        counts[s] += n
    return counts


def reader_rows(open_stream, make_rows, group: int, reader: int, readers: int, state: dict | None = None,
                shuffle_seed: int | None = None):  # fmt: skip
    """Reader `reader` of `readers`: (training row, position after it) forever, epoch after epoch. With
    `shuffle_seed`, each group's rows come in an order drawn from the seed and the group's position."""
    stream = split_dataset_by_node(open_stream(), rank=reader, world_size=readers)
    state = state or {"epoch": 0, "stream": None, "carry": None, "delivered": 0}
    epoch, position, carry, skip = state["epoch"], state["stream"], state["carry"], state["delivered"]
    while True:
        from_start, made = position is None, 0
        stream.set_epoch(epoch)
        if position is not None:
            stream.load_state_dict(position)
        for batch in stream.iter(batch_size=group):
            rows, after = make_rows(batch, carry)
            if shuffle_seed is not None:
                rows = _shuffled(rows, shuffle_seed, epoch, reader, position)
            for r in range(skip, len(rows)):
                yield rows[r], {"epoch": epoch, "stream": position, "carry": carry, "delivered": r + 1}
            made, skip = made + len(rows), 0
            position, carry = stream.state_dict(), after
        if from_start and made == 0 and not carry:
            raise DataError(f"streamed train_data: reader {reader} of {readers} (processes x dataloader workers) got "
                            "no rows in a whole pass: the data has fewer rows than readers, or none left after "
                            "filtering; use fewer workers or processes")  # fmt: skip
        epoch, position = epoch + 1, None


def _shuffled(rows: list, seed: int, epoch: int, reader: int, position: dict | None) -> list:
    # A shuffle buffer (datasets' own) is not restored on resume, so a resumed run would train on other rows. A
    # permutation of the group, drawn from where the group starts, is the same when a resumed reader reads the
    # group again: its `delivered` count then skips the same rows.
    where = json.dumps([seed, epoch, reader, position], sort_keys=True, default=str).encode()
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(where).digest()[:8], "little"))
    return [rows[i] for i in rng.permutation(len(rows))]
