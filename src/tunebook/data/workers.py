"""DataLoader workers: how they start (forked, or from a fork server in a multi-process run), the signals they leave
to the training process, and their end when it exits. Used by the map-style loaders (`tunebook.data.loaders`) and the
streamed one (`tunebook.data.stream.loader`) alike."""

from __future__ import annotations

import atexit
import functools
import inspect
import multiprocessing
import signal
import sys
import threading

__all__ = ["ignore_stop_signals", "start_worker_server", "worker_options", "worker_start_method"]


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
