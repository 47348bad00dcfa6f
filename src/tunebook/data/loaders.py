"""DataLoader construction: seeded shuffling, workers and pinned memory."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["build_loader"]


def build_loader(
    dataset: Dataset,
    batch_size: int,
    collate_fn: Callable,
    *,
    shuffle: bool,
    seed: int,
    num_workers: int = 0,
    pin_memory: bool = True,
) -> DataLoader:
    """A DataLoader whose order depends only on `seed` (its own generator, not the global RNG).

    `pin_memory` is applied only when CUDA is available, where it enables asynchronous host-to-device copies.
    """
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        collate_fn=collate_fn,
        generator=generator,
        num_workers=num_workers,
        pin_memory=pin_memory and torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        drop_last=False,
    )
