"""DataLoader construction: seeded order, length grouping, workers, pinned memory and prefetch."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .collate import PackedCollator
from .resumable import ResumableLoader, resumable
from .stream import StreamLoader, TokenStream
from .workers import start_worker_server, worker_options

__all__ = [
    "LengthGroupedSampler",
    "build_loader",
    "fixed_batch_shape",
    "start_worker_server",  # from .workers, where `tunebook.training.loop` imports it from here
    "train_and_eval_loaders",
]


class LengthGroupedSampler(Sampler[int]):
    """A seeded random order in which each batch holds examples of similar length.

    Shuffles all indices, cuts them into mega-batches of `group_batches` batches, and sorts each mega-batch by
    length (longest first), so a batch pads only to lengths close to its own. The order depends only on the seed
    and the epoch (`set_epoch`), never on the global RNG, so every process sees the same order and Accelerate can
    hand consecutive batches to consecutive processes. The batch with the longest example goes first, so a run
    that will run out of memory does so at its first step.

    Pass the global batch (per-device batch x processes x accumulation steps) as `batch_size`: the order then
    does not depend on how a step is split across processes and micro-batches, so 2 processes x batch 4 train
    on exactly the examples of 1 process x batch 8.
    """

    def __init__(self, lengths: np.ndarray, batch_size: int, seed: int, group_batches: int = 50):
        self.lengths = np.asarray(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.group = batch_size * group_batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.lengths))
        groups = [order[i : i + self.group] for i in range(0, len(order), self.group)]
        groups = [g[np.argsort(-self.lengths[g], kind="stable")] for g in groups]
        order = np.concatenate(groups) if groups else order
        # Move the batch holding the longest example to the front.
        first = int(np.argmax(self.lengths[order])) // self.batch_size * self.batch_size
        if first:
            head = order[first : first + self.batch_size].copy()
            order = np.concatenate([head, np.delete(order, np.s_[first : first + self.batch_size])])
        return (int(i) for i in order)  # lazily: a list of every index would be ~36 bytes per example


def build_loader(
    dataset: Dataset,
    batch_size: int,
    collate_fn: Callable,
    *,
    shuffle: bool,
    seed: int,
    lengths: np.ndarray | None = None,
    group_size: int | None = None,
    num_workers: int = 0,
    pin_memory: bool = True,
    prefetch_factor: int | None = 2,
) -> DataLoader:
    """A DataLoader whose order depends only on `seed` (its own generator, not the global RNG).

    With `lengths` (and `shuffle`), batches group examples of similar length (`LengthGroupedSampler` over
    `group_size`, the global batch, defaulting to `batch_size`). Workers
    collate in the background and stay alive across epochs; `pin_memory` applies only when CUDA is available,
    where it lets host-to-device copies run asynchronously (Accelerate's `non_blocking`).
    """
    generator = torch.Generator()
    generator.manual_seed(seed)
    sampler = None
    if shuffle and lengths is not None:
        sampler = LengthGroupedSampler(lengths, group_size or batch_size, seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle if sampler is None else False,
        sampler=sampler,
        collate_fn=collate_fn,
        generator=generator,
        num_workers=num_workers,
        pin_memory=pin_memory and torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        drop_last=False,
        **worker_options(num_workers, prefetch_factor),
    )


def train_and_eval_loaders(
    config, train: Dataset | TokenStream, evaluation: Dataset | None, collate_fn: Callable, **grouping
) -> tuple[DataLoader | StreamLoader, DataLoader | None]:
    """A run's loaders with its `dataloader_*` keys: `train` shuffled by `seed` (`grouping`: `lengths` and
    `group_size` batch similar lengths together), or a `TokenStream` read in order through a `StreamLoader`;
    `evaluation` in order (None when there is no eval data)."""
    train_collate = collate_fn
    # Packed rows get one shape for compiled blocks: under torch_compile: true, and under auto where CUDA may compile
    # them (`should_compile` decides once the run's length is known; rows padded to max_seq_length cost little).
    compiling = config.torch_compile is True or (config.torch_compile == "auto" and torch.cuda.is_available())
    if compiling and isinstance(collate_fn, PackedCollator):
        train_collate = copy.copy(collate_fn)
        train_collate.row_length, train_collate.rows = config.max_seq_length, config.per_device_train_batch_size
    common = {
        "seed": config.seed,
        "num_workers": config.dataloader_num_workers,
        "pin_memory": config.dataloader_pin_memory,
        "prefetch_factor": config.dataloader_prefetch_factor,
    }
    if isinstance(train, TokenStream):  # streaming: true: rows made and collated in the workers
        train.collate = train_collate
        batches = config.max_steps * config.gradient_accumulation_steps
        train_loader = StreamLoader(train, batches, config.dataloader_num_workers, config.dataloader_prefetch_factor,
                                    config.dataloader_pin_memory, config.dataloader_non_blocking)  # fmt: skip
    else:
        train_loader = build_loader(train, config.per_device_train_batch_size, train_collate, shuffle=True, **grouping,
                                    **common)  # fmt: skip
    eval_loader = None
    if evaluation is not None:
        eval_loader = build_loader(evaluation, config.per_device_eval_batch_size, collate_fn, shuffle=False, **common)
    return train_loader, eval_loader


def fixed_batch_shape(loader: DataLoader | ResumableLoader) -> tuple[int, int] | None:
    """(rows, length) of every batch of `loader` (packed rows under torch_compile), or None where batches change
    shape."""
    collate = resumable(loader).collate
    if isinstance(collate, PackedCollator) and collate.rows and collate.row_length:
        return collate.rows, collate.row_length
    return None
