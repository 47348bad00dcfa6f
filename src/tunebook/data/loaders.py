"""DataLoader construction: seeded order, length grouping, workers, pinned memory and prefetch."""

from __future__ import annotations

import atexit
import copy
import functools
import inspect
import multiprocessing
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["LengthGroupedSampler", "build_loader", "fixed_batch_shape", "train_and_eval_loaders"]


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


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader worker init: leave SIGTERM/SIGINT to the training process.

    SLURM preemption and Ctrl-C signal every process of the job, workers included; a worker that died of it would
    make the training process fail ("DataLoader worker is killed by signal") before it could save a checkpoint.
    The training process stops its workers itself: through the loader when it is released, and, should it exit
    while a loader is still held (an error's traceback keeps it), with `_kill_workers_at_exit`.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _kill_workers_at_exit() -> None:
    # multiprocessing ends daemonic children at exit with SIGTERM, which our workers ignore: SIGKILL them first.
    # Registered after multiprocessing's own exit hook, so it runs before it.
    children = [c for c in multiprocessing.active_children() if c.daemon]
    if not children:
        return
    # torch's SIGCHLD handler raises in the main process when a worker dies ("DataLoader worker is killed by
    # signal"); raised inside this hook it would stop it halfway and leave the other workers alive, and
    # multiprocessing would then wait for them forever. At exit their deaths are expected: default handling.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=5)


_kill_workers_at_exit_registered = functools.cache(lambda: atexit.register(_kill_workers_at_exit))  # by a run


def worker_start_method() -> str | None:
    """How DataLoader workers start: from a fork server in a process that is one of several in a process group,
    else by forking the training process (Python's default on Linux, None).

    A fork copies the training process's locks in whatever state its other threads hold them. Under gloo, NCCL or
    DeepSpeed such threads run the collectives around the first batch, and a worker forked while one of them held
    a lock that the fork does not reset waits for it forever, and its rank for the worker's batch while the other
    ranks wait in their next collective: seen in 4 of 141 runs of GRPO under ZeRO-3 on 2 CPU processes, the worker
    stuck inside `os.fork` (pytorch#75147, #130610). The fork server is a fresh single-threaded interpreter that
    imports the process's Tunebook modules once (in the background, from `start_worker_server`) and forks every
    worker.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return "forkserver"
    return None


def _started_under_main_guard() -> bool:
    """Whether the launched script started this run from under its `if __name__ == "__main__":` (or was not run
    from a file): the line its top level is executing lies inside such a block."""
    import ast

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frame, line = inspect.currentframe(), None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is getattr(main, "__dict__", None):
            line = frame.f_lineno
        frame = frame.f_back
    if line is None or not path or not str(path).endswith(".py"):
        return True
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    tests = {'__name__ == "__main__"', '"__main__" == __name__'}
    return any(
        isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') in tests
        and node.lineno <= line <= node.end_lineno
        for node in tree.body
    )  # fmt: skip


def start_worker_server(num_workers: int) -> None:
    """Start the fork server now, where workers will come from it, so that its imports overlap the run's model and
    data preparation instead of delaying the first batch.

    It imports the Tunebook modules this process has imported, and with them torch, transformers and datasets:
    Python 3.11's fork server never imports the launched script as asked (it looks for a `main_path` key that
    `spawn.get_preparation_data` calls `init_main_from_path`), so each worker would import the script's libraries
    again, ~2 s each, where it now runs only the script's own top level.
    """
    if num_workers > 0 and worker_start_method() == "forkserver":
        from multiprocessing import forkserver

        if not _started_under_main_guard():  # each worker imports the script: it would train again in each
            from ..errors import ConfigError

            raise ConfigError(
                f"{sys.modules['__main__'].__file__} starts its run when it is imported: the DataLoader workers of a "
                "multi-process run come from a fork server and import the launched script; put its run under "
                '`if __name__ == "__main__":` (as recipes/sft.py does), or set dataloader_num_workers: 0'
            )

        forkserver.set_forkserver_preload(sorted(name for name in sys.modules if name.startswith("tunebook.")))
        forkserver.ensure_running()


def worker_options(num_workers: int, prefetch_factor: int | None) -> dict:
    """The DataLoader arguments that only apply with workers: how they start, what they ignore, how far ahead."""
    if num_workers == 0:
        return {"multiprocessing_context": None, "prefetch_factor": None, "worker_init_fn": None}
    _kill_workers_at_exit_registered()  # the run starts workers: they end with the process
    return {"multiprocessing_context": worker_start_method(), "prefetch_factor": prefetch_factor,
            "worker_init_fn": ignore_stop_signals}  # fmt: skip


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


def train_and_eval_loaders(config, train: Dataset, evaluation: Dataset | None, collate_fn: Callable, **grouping):
    """A run's loaders with its `dataloader_*` keys: `train` shuffled by `seed` (`grouping`: `lengths` and
    `group_size` batch similar lengths together), or a `TokenStream` read in order through a `StreamLoader`;
    `evaluation` in order (None when there is no eval data)."""
    train_collate = collate_fn
    # Packed rows get one shape for compiled blocks: under torch_compile: true, and under auto where CUDA may compile
    # them (`should_compile` decides once the run's length is known; rows padded to max_seq_length cost little).
    compiling = config.torch_compile is True or (config.torch_compile == "auto" and torch.cuda.is_available())
    if compiling and hasattr(collate_fn, "row_length"):
        train_collate = copy.copy(collate_fn)
        train_collate.row_length, train_collate.rows = config.max_seq_length, config.per_device_train_batch_size
    common = {
        "seed": config.seed,
        "num_workers": config.dataloader_num_workers,
        "pin_memory": config.dataloader_pin_memory,
        "prefetch_factor": config.dataloader_prefetch_factor,
    }
    if hasattr(train, "preview"):  # a TokenStream (streaming: true): rows made and collated in the workers
        from .streaming import StreamLoader

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


def fixed_batch_shape(loader) -> tuple[int, int] | None:
    """(rows, length) of every batch of `loader` (packed rows under torch_compile), or None where batches change
    shape."""
    collate = getattr(loader, "collate_fn", None) or getattr(getattr(loader, "stream", None), "collate", None)
    rows, length = getattr(collate, "rows", None), getattr(collate, "row_length", None)
    return (rows, length) if rows and length else None
