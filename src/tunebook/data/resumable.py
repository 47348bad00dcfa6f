"""The training loader as the loop sees it: one interface for a map-style loader and a streamed one.

The loop asks its training loader the same questions whatever it reads: does it stream, what position does a
checkpoint keep of it and how is it restored, which sources did it deliver how many tokens from. A streamed loader
(`tunebook.data.stream.StreamLoader`) answers them itself. A map-style loader is a torch `DataLoader` that Accelerate
replaces by its own class in `prepare`, so it cannot carry methods of ours: `MapLoader` answers for it, and
`resumable(loader)` gives either one the interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

__all__ = ["MapLoader", "ResumableLoader", "resumable"]


class ResumableLoader(ABC):
    """What the loop asks of a training loader (besides iterating it) to resume it exactly where a checkpoint left
    it, and to report what it delivered."""

    @property
    @abstractmethod
    def streams(self) -> bool:
        """True for a stream: the loader keeps its own position (`state_dict`), and a resumed run restores it instead
        of skipping the batches trained on. False for a map-style loader: its position is the run's epoch and
        batches into it, and a resumed run skips those batches at the sampler (nothing is read twice)."""

    @property
    @abstractmethod
    def source_names(self) -> list[str]:
        """The sources whose tokens `delivered` counts, as the logs name them; empty where they are not counted."""

    @property
    @abstractmethod
    def collate(self) -> Callable | None:
        """The function that turns rows into a batch."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any] | None:
        """The position a checkpoint keeps of the loader, or None where the run's own counters are its position."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue from `state_dict()`'s position."""

    @abstractmethod
    def delivered(self, accelerator) -> dict[str, dict[str, float]]:
        """Tokens trained on from each of `source_names`, over all processes, and their shares."""

    @abstractmethod
    def examples_read(self, accelerator) -> dict[str, int]:
        """Examples read while training (and how many were truncated or dropped), over all processes; empty where
        they were counted before training (the prepared data's stats)."""


class MapLoader(ResumableLoader):
    """A map-style loader (a torch `DataLoader`, or the one Accelerate prepared from it) as a `ResumableLoader`: it
    does not stream, its position is the run's, and its tokens were counted when its data set was prepared."""

    def __init__(self, loader):
        self.loader = loader

    @property
    def streams(self) -> bool:
        return False

    @property
    def source_names(self) -> list[str]:
        return []  # its data set was counted, per source, when it was prepared

    @property
    def collate(self) -> Callable | None:
        return self.loader.collate_fn

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            raise ValueError(
                "a map-style loader keeps no position of its own: the run skips the batches it trained on"
            )

    def delivered(self, accelerator) -> dict[str, dict[str, float]]:
        return {}

    def examples_read(self, accelerator) -> dict[str, int]:
        return {}


def resumable(loader) -> ResumableLoader:
    """`loader` as a `ResumableLoader`: itself where it is one (a stream), else a map-style `DataLoader` in a
    `MapLoader`."""
    return loader if isinstance(loader, ResumableLoader) else MapLoader(loader)
