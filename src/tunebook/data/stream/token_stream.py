"""The torch side of a streamed source: `TokenStream`, the `IterableDataset` each loader worker reads its reader's
rows from, collated into batches that carry the worker's position."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import datasets
import numpy as np
import torch
from torch.utils.data import IterableDataset

from ...errors import TunebookError, first_line
from .rows import reader_rows

__all__ = ["BOOKS", "STATE", "TokenStream", "process_position"]

STATE = "_stream_state"  # the key under which a worker sends its position along with each batch
BOOKS = ("source_tokens", "examples")  # what a row carries for the loader's counts, not for the model


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
