"""Streamed training data: sources read shard by shard, tokenised and packed on the fly in the loader's workers, at
a position every checkpoint saves and a resumed run continues from exactly.

A streamed run has G = processes x max(workers, 1) readers. Reader g reads `split_dataset_by_node(mixture, g, G)`:
whole shards (files) when G divides their number, else every G-th row (then every reader reads every file: give a
corpus a multiple of G files). A reader takes `group` rows at a time and turns each group into training rows
(pretrain: documents cut into rows of `max_seq_length`, the unfinished row carried into the next group; sft:
examples, or rows packed best-fit within the group, `packing_buffer_size`). It loops over epochs itself, so the
stream never ends and the row in flight at an epoch's end is finished with the next epoch's documents.

A reader's position is where its current group starts (the Hugging Face stream's own `state_dict`, exact at a batch
boundary), the row carried into the group, and how many of the group's rows were delivered. A resumed reader reads
that one group again and skips what was delivered: a few KB of state, where the packing buffer itself would be
megabytes to ship from a worker with every batch. The stream's shuffle buffer is not used: datasets does not restore
its contents on resume (its `state_dict` documentation says so), and a resumed run would train on other rows.

Each worker puts its position on every batch it makes; `StreamLoader` keeps the latest position of each worker as
the loop takes batches, so a checkpoint holds the position of what was trained on, not of what was prefetched.
torch's loader takes batches from workers 0, 1, ..., W-1 in turn and a new loader starts again at worker 0, so after
n batches worker j plays the part (reader and position) of worker (j + n) mod W and the order goes on unchanged.
torchdata's `StatefulDataLoader` keeps the same books; it is not a dependency of Tunebook.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from datasets.distributed import split_dataset_by_node
from torch.utils.data import DataLoader, IterableDataset

from ..errors import ConfigError, DataError, TunebookError, first_line
from .formats import detect_format, to_conversations
from .loaders import worker_options
from .packing import best_fit_decreasing, concatenate_examples
from .sources import DataSource, _load, _quiet_datasets, _resolve
from .tokenize import longest_token_chars, tokenize_conversations

__all__ = [
    "ChatRows",
    "StreamLoader",
    "TextRows",
    "TokenStream",
    "Mixture",
    "is_streamed",
    "process_position",
    "source_names",
    "stream_fingerprint",
]

STATE = "_stream_state"  # the key under which a worker sends its position along with each batch
# A folder of prepared shards (`tunebook prepare --output`): what made them, and its tokenizer. Names starting with
# "_" are not read as data files (tunebook.data.sources).
PREPARED = "_tunebook_prepared.json"
PREPARED_TOKENIZER = "_tokenizer"
ROW_COLUMNS = ("input_ids", "labels", "seq_lengths")
BOOKS = ("source_tokens", "examples")  # what a row carries for the loader's counts, not for the model
EXAMPLE_COUNTS = ("examples_read", "truncated", "dropped_overlong", "dropped_no_loss_tokens")


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


# --------------------------------------------------------------------------------------------------------------
# Groups of streamed rows -> training rows


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


class TokenStream(IterableDataset):
    """The torch side of a streamed source: in each loader worker, its reader's rows collated into batches, each
    carrying the worker's position (`STATE`). `StreamLoader` sets `positions` and `offset` before it starts workers."""

    def __init__(self, open_stream, make_rows, group: int, batch_size: int, process_index: int, num_processes: int,
                 source_names: list[str], shuffle_seed: int | None = None):  # fmt: skip
        self.open_stream, self.make_rows, self.group, self.batch_size = open_stream, make_rows, group, batch_size
        self.shuffle_seed = shuffle_seed
        self.process_index, self.num_processes, self.source_names = process_index, num_processes, source_names
        self.collate: Callable | None = None
        self.positions: dict[int, dict] = {}
        self.offset = 0

    def check_readers(self, num_workers: int, log: logging.Logger) -> None:
        """Warn when the readers cannot take whole shards: each then reads every file and skips most rows."""
        shards, readers = self.open_stream().num_shards, self.num_processes * max(num_workers, 1)
        if shards % readers:
            log.warning("streamed train_data has %d shard(s) (files) for %d readers (%d process(es) x %d loader "
                        "worker(s)): each reader reads every shard and keeps 1 row in %d; give it a multiple of %d "
                        "files (tunebook prepare --num_shards) to read nothing twice", shards, readers,
                        self.num_processes, max(num_workers, 1), readers, readers)  # fmt: skip

    def preview(self, count: int = 64) -> datasets.Dataset:
        """The first rows reader 0 makes, as a Dataset: for the logged example and the FLOPs estimate."""
        rows = itertools.islice(reader_rows(self.open_stream, self.make_rows, self.group, 0, 1,
                                            shuffle_seed=self.shuffle_seed), count)  # fmt: skip
        return datasets.Dataset.from_list([{k: v for k, v in row.items() if k not in BOOKS} for row, _ in rows])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        role = (worker + self.offset) % workers
        try:
            rows = reader_rows(self.open_stream, self.make_rows, self.group, self.process_index * workers + role,
                               self.num_processes * workers, self.positions.get(role), self.shuffle_seed)  # fmt: skip
            while True:
                taken = list(itertools.islice(rows, self.batch_size))
                features = [{k: v for k, v in row.items() if k not in BOOKS} for row, _ in taken]
                tokens = np.sum([row["source_tokens"] for row, _ in taken], axis=0).tolist()
                examples = np.sum([row.get("examples", [0] * 4) for row, _ in taken], axis=0).tolist()
                yield {**self.collate(features), STATE: {"role": role, "position": taken[-1][1], "tokens": tokens,
                                                         "examples": examples}}  # fmt: skip
        except TunebookError as error:  # sent as a batch: raised by a worker it would reach the loop as a traceback
            yield {STATE: {"error": str(error)}}
        except Exception as error:
            yield {STATE: {"error": f"streamed train_data: {type(error).__name__}: {first_line(error)}"}}


def process_position() -> tuple[int, int]:
    """(this process's index, the number of processes): which readers this process runs."""
    from accelerate import PartialState

    state = PartialState()
    return state.process_index, state.num_processes


def _as_is(batch):
    return batch


class StreamLoader:
    """The training loader of a streamed run: iterates a `TokenStream` through a torch DataLoader (workers, prefetch,
    pinned memory), moves batches to the device, and keeps the position and the tokens of each source of what the
    loop took. Not prepared by Accelerate: its processes already read different rows, which `prepare` would split
    again. `__len__` is the run's micro-batches (`max_steps` x accumulation): a stream has no epochs to count."""

    resumes_itself = True  # the loop restores its position, rather than skipping batches (`tunebook.training.loop`)

    def __init__(self, stream: TokenStream, batches: int, num_workers: int, prefetch_factor: int | None,
                 pin_memory: bool, non_blocking: bool, log: logging.Logger | None = None):  # fmt: skip
        self.stream, self.batches, self.num_workers = stream, batches, num_workers
        self.prefetch_factor, self.pin_memory, self.non_blocking = prefetch_factor, pin_memory, non_blocking
        self.positions: dict[int, dict] = {}
        self.taken = 0
        self.tokens = [0] * len(stream.source_names)
        self.examples = [0] * len(EXAMPLE_COUNTS)

    def __len__(self) -> int:
        return self.batches

    def set_epoch(self, epoch: int) -> None:  # a stream's epochs are its readers' own
        pass

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        from accelerate import PartialState

        device = PartialState().device
        self.stream.positions, self.stream.offset = dict(self.positions), self.taken
        workers = self.num_workers
        loader = DataLoader(self.stream, batch_size=None, collate_fn=_as_is, num_workers=workers,
                            pin_memory=self.pin_memory and torch.cuda.is_available(),
                            **worker_options(workers, self.prefetch_factor))  # fmt: skip
        for batch in loader:
            info = batch.pop(STATE)
            if "error" in info:
                raise DataError(info["error"])
            self.positions[info["role"]] = info["position"]
            self.taken += 1
            self.tokens = [a + b for a, b in zip(self.tokens, info["tokens"])]
            self.examples = [a + b for a, b in zip(self.examples, info["examples"])]
            yield {k: v.to(device, non_blocking=self.non_blocking) for k, v in batch.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"workers": max(self.num_workers, 1), "taken": self.taken, "tokens": self.tokens,
                "examples": self.examples, "positions": {str(k): v for k, v in self.positions.items()}}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["workers"] != max(self.num_workers, 1):
            raise ConfigError(
                f"dataloader_num_workers: the checkpoint's stream was read by {state['workers']} reader(s) per process "
                f"and this run has {max(self.num_workers, 1)}; resume with dataloader_num_workers "
                f"{state['workers'] if state['workers'] > 1 else 0} (the readers decide which rows each one reads)"
            )
        self.taken, self.tokens = state["taken"], list(state["tokens"])
        self.examples = list(state.get("examples", self.examples))
        self.positions = {int(k): v for k, v in state["positions"].items()}

    def examples_read(self, accelerator) -> dict[str, int]:
        """sft: the examples read into the groups trained on so far, and how many were truncated or dropped (as the
        cached path counts them before training), over all processes."""
        total = accelerator.reduce(torch.tensor(self.examples, dtype=torch.float64, device=accelerator.device), "sum")
        return dict(zip(EXAMPLE_COUNTS, (int(n) for n in total.tolist())))

    def delivered(self, accelerator) -> dict[str, dict[str, float]]:
        """Tokens trained on from each source, over all processes, and their shares."""
        total = accelerator.reduce(torch.tensor(self.tokens, dtype=torch.float64, device=accelerator.device), "sum")
        counts = total.tolist()
        whole = sum(counts) or 1.0
        return {name: {"tokens": int(n), "share": n / whole} for name, n in zip(self.stream.source_names, counts)}


# --------------------------------------------------------------------------------------------------------------
# Prepared shards: tokenised once, streamed by any number of nodes


def prepared_meta(source: DataSource) -> dict[str, Any] | None:
    """What `tunebook prepare --output` recorded in a folder of prepared shards; None for other sources."""
    path = Path(source.path).expanduser() / PREPARED
    return json.loads(path.read_text()) if source.is_local and path.is_file() else None


def prepared_tokenizer(sources: list[DataSource], config, recipe: str):
    """The tokenizer of streamed prepared shards, checked against the run: the shards' own unless the config names
    one (which must then be the same); None when the sources are not prepared shards."""
    from .cache import tokenizer_fingerprint
    from .tokenizer import load_tokenizer

    metas = [prepared_meta(s) for s in sources]
    if not all(metas):
        return None
    for source, meta in zip(sources, metas):
        made = {"recipe": recipe, "max_seq_length": config.max_seq_length, "packing": getattr(config, "packing", True)}
        for key, value in made.items():
            if meta[key] != value:
                raise ConfigError(f"{source.path} was prepared with {key} {meta[key]!r} and this run has {value!r}; "
                                  f"set {key}: {meta[key]!r}, or prepare it again")  # fmt: skip
    named = config.tokenizer_name_or_path or config.model_name_or_path
    tokenizer = load_tokenizer(named or str(Path(sources[0].path).expanduser() / PREPARED_TOKENIZER),
                               config.trust_remote_code)  # fmt: skip
    for source, meta in zip(sources, metas):
        if meta["tokenizer"] != tokenizer_fingerprint(tokenizer):
            raise ConfigError(f"{source.path} was tokenised with another tokenizer than {named}; use the one saved "
                              f"with the shards ({source.path}/{PREPARED_TOKENIZER}), or prepare it again")  # fmt: skip
    return tokenizer


def write_prepared_shards(dataset: datasets.Dataset, tokenizer, output: Path, num_shards: int, meta: dict) -> list:
    """`dataset`'s rows as `num_shards` Arrow files in `output` (each written whole, then renamed into place), the
    tokenizer and what made them: a folder any number of nodes stream with `{path: output, streaming: true}`."""
    import pyarrow as pa

    from .cache import tokenizer_fingerprint

    if not 1 <= num_shards <= len(dataset):
        raise ConfigError(f"--num_shards {num_shards}: must be between 1 and the {len(dataset)} rows prepared")
    output.mkdir(parents=True, exist_ok=True)
    for old in output.glob("train-*-of-*.arrow"):
        old.unlink()
    dataset = dataset.select_columns([c for c in ROW_COLUMNS if c in dataset.column_names])
    paths = []
    for index in range(num_shards):
        table = dataset.shard(num_shards, index, contiguous=True).with_format("arrow")[:]
        path = output / f"train-{index:05d}-of-{num_shards:05d}.arrow"
        tmp = path.with_name(f".{path.name}.tmp")
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=1000)  # record batches a reader can resume between
        tmp.rename(path)
        paths.append(path)
    tokenizer.save_pretrained(output / PREPARED_TOKENIZER)
    (output / PREPARED).write_text(json.dumps({**meta, "tokenizer": tokenizer_fingerprint(tokenizer),
                                               "num_shards": num_shards, "rows": len(dataset)}, indent=2))  # fmt: skip
    return paths


def source_names(sources: list[DataSource]) -> list[str]:
    """How the logs and summary name each source: its file or folder name, its path when names repeat."""
    names = [Path(s.path).name or s.path for s in sources]
    return [s.path if names.count(n) > 1 else n for s, n in zip(sources, names)]
