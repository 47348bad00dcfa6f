"""The scaffold every evaluation shares: iterate the loader with the model in eval mode, run the task's per-batch
computation without gradients, gather its result from every process and drop the duplicates that even out the last
batch (`gather_for_metrics`). The task folds the gathered batches into its figures: the result then equals a
single-process evaluation on any number of processes."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..progress import progress_bar

__all__ = ["gathered_batches"]


def gathered_batches(
    model: torch.nn.Module,
    loader: Iterable,
    accelerator,
    compute: Callable[[Any], Any],
    *,
    objects: bool = False,
    desc: str = "Evaluating",
    disable_tqdm: bool = True,
) -> Iterator[Any]:
    """Each batch's `compute(batch)` (tensors, or with `objects` any picklable values such as strings), gathered
    from every process with the last batch's duplicates dropped. The model is in eval mode while the batches run and
    in its former mode afterwards, also when the caller stops early or raises."""
    was_training = model.training
    model.eval()
    try:
        for batch in progress_bar(accelerator.is_main_process, disable_tqdm, iterable=loader, desc=desc, leave=False):
            with torch.no_grad():
                result = compute(batch)
            yield accelerator.gather_for_metrics(result, use_gather_object=objects)
    finally:
        model.train(was_training)
