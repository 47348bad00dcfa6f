"""Step arithmetic: how many optimizer steps a run takes, which micro-batches make one, and when gradients sync."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any

from .. import compat

__all__ = ["accumulation_windows", "eval_due", "micro_batch", "save_due", "total_optimizer_steps"]


def total_optimizer_steps(
    max_steps: int,
    num_train_epochs: float,
    batches_per_epoch: int,
    gradient_accumulation_steps: int,
    updates_per_window: int = 1,
) -> tuple[int, int]:
    """Return (total optimizer steps, optimizer steps per epoch).

    `batches_per_epoch` is per process (the prepared loader's length). The last, partial accumulation window of
    an epoch still makes an optimizer step (`updates_per_window` of them where a window is trained on several
    times, as GRPO's `num_iterations`). `max_steps` > 0 wins over epochs; 0 means evaluate only.
    """
    windows = max(math.ceil(batches_per_epoch / gradient_accumulation_steps), 1)
    steps_per_epoch = windows * updates_per_window
    if max_steps >= 0:
        return max_steps, steps_per_epoch
    return math.ceil(num_train_epochs * steps_per_epoch), steps_per_epoch


def accumulation_windows(
    loader: Iterable[Any], gradient_accumulation_steps: int, timer: Any = None
) -> Iterator[list[Any]]:
    """Group an epoch's micro-batches into the windows of one optimizer step each (the last may be shorter).

    Fetching a whole window first lets the loss be normalised by the loss tokens of the entire step before the
    first backward. The last window is yielded while the loader is still suspended on its final batch: an
    Accelerate loader then still reports `end_of_dataloader`, which `accelerator.accumulate` needs to sync
    gradients at the end of a shorter final window (once the loader is exhausted, it no longer does).
    With a `timer` (`tunebook.run.logging.RunTimer`), the time spent waiting for each batch is added to it.
    """
    window: list[Any] = []
    batches = iter(loader)
    while True:
        start = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            break
        if timer is not None:
            timer.add_data_wait(time.perf_counter() - start)
        window.append(batch)
        if len(window) == gradient_accumulation_steps or getattr(loader, "end_of_dataloader", False):
            yield window
            window = []
    if window:  # plain DataLoaders, which do not announce their last batch
        yield window


@contextlib.contextmanager
def micro_batch(accelerator, model, last: bool):
    """`accelerator.accumulate(model)` for one micro-batch of a window, syncing where the window ends (`last`): the
    backward reduces gradients across processes, and DeepSpeed's engine applies its update, only there.

    Accelerate's own counter also syncs wherever its loader reports its end, and `accumulation_windows` fetches a
    window whole before its first backward: every micro-batch of an epoch's last window synced. Under DDP that was
    only extra all-reduces; under DeepSpeed the engine stepped after each of them, a different update.
    """
    compat.set_sync_gradients(accelerator, last)
    with contextlib.nullcontext() if last else accelerator.no_sync(model):
        yield


def eval_due(config, global_step: int, total_steps: int, epoch_done: bool) -> bool:
    """Whether to evaluate after this optimizer step (the end of training has its own evaluation)."""
    if global_step >= total_steps:
        return False
    if config.eval_strategy == "epoch":
        return epoch_done
    return bool(config.eval_steps) and global_step % config.eval_steps == 0


def save_due(config, global_step: int, epoch_done: bool, new_best: bool) -> str | None:
    """Why to save a checkpoint after this optimizer step, or None."""
    if config.save_strategy == "steps" and config.save_steps and global_step % config.save_steps == 0:
        return f"every {config.save_steps} steps"
    if config.save_strategy == "epoch" and epoch_done:
        return "end of an epoch"
    if new_best and config.load_best_model_at_end:
        return "best evaluation so far"
    return None
