"""`StreamLoader`: the training loader of a streamed run, resumable at the position of what the loop trained on."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from ...errors import ConfigError, DataError
from ..resumable import ResumableLoader
from ..workers import worker_options
from .token_stream import STATE, TokenStream

__all__ = ["EXAMPLE_COUNTS", "StreamLoader"]

EXAMPLE_COUNTS = ("examples_read", "truncated", "dropped_overlong", "dropped_no_loss_tokens")


def _as_is(batch):
    return batch


class StreamLoader(ResumableLoader):
    """The training loader of a streamed run: iterates a `TokenStream` through a torch DataLoader (workers, prefetch,
    pinned memory), moves batches to the device, and keeps the position and the tokens of each source of what the
    loop took. Not prepared by Accelerate: its processes already read different rows, which `prepare` would split
    again. `__len__` is the run's micro-batches (`max_steps` x accumulation): a stream has no epochs to count."""

    def __init__(self, stream: TokenStream, batches: int, num_workers: int, prefetch_factor: int | None,
                 pin_memory: bool, non_blocking: bool, log: logging.Logger | None = None):  # fmt: skip
        self.stream, self.batches, self.num_workers = stream, batches, num_workers
        self.prefetch_factor, self.pin_memory, self.non_blocking = prefetch_factor, pin_memory, non_blocking
        self.positions: dict[int, dict] = {}
        self.taken = 0
        self.tokens = [0] * len(stream.source_names)
        self.examples = [0] * len(EXAMPLE_COUNTS)

    @property
    def streams(self) -> bool:
        return True  # the loop restores its position, rather than skipping batches (`tunebook.training.loop`)

    @property
    def source_names(self) -> list[str]:
        return self.stream.source_names

    @property
    def collate(self) -> Callable | None:
        return self.stream.collate

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
