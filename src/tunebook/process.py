"""What a Tunebook command that owns its process keeps about it, below every package that reads it: when the
user's command started (`launch_time`, passed to the launched processes in the environment) and the cyclic
garbage collector's pause while a run starts (`pause_collector` by `tunebook train`, `resume_collector` by the
recipe's `start_run`)."""

from __future__ import annotations

import gc
import os
import time

__all__ = ["LAUNCH_TIME_VARIABLE", "launch_time", "pause_collector", "resume_collector"]

LAUNCH_TIME_VARIABLE = "TUNEBOOK_LAUNCH_TIME"

# Whether `pause_collector` paused the collector and `resume_collector` has not yet resumed it.
_COLLECTOR_PAUSED = [False]


def pause_collector() -> None:
    """Pause Python's cyclic garbage collector while a run that owns its process starts: `resume_collector` (the
    recipe's `start_run`) freezes what exists then and resumes collection for what comes after.

    Importing torch, transformers, datasets and accelerate creates ~400,000 objects that live as long as the process,
    and the collector scanned them again and again as they came: every run's start-up made seven full collections,
    0.5 s, that freed almost nothing (0 to 40 objects each). Frozen, they are not scanned by the collections that
    follow either: those at a run's end (matplotlib's import for report.png, the model's release) took 0.58 s before
    and take 0.04 s. This is the pattern Python's documentation gives for `gc.freeze`, which also spares the
    DataLoader's forked workers from copying the pages that the collector would otherwise write to.
    """
    gc.disable()
    _COLLECTOR_PAUSED[0] = True


def resume_collector(freeze: bool = False) -> None:
    """End `pause_collector`'s pause, if there is one; with `freeze`, what exists now is moved out of the collector's
    sight for good (modules, classes, functions: as good as all of it lives as long as the process)."""
    if _COLLECTOR_PAUSED[0]:
        _COLLECTOR_PAUSED[0] = False
        if freeze:
            gc.freeze()
        gc.enable()


def launch_time() -> float:
    """When the user's command started (epoch seconds): this process's start, or its launcher's."""
    if LAUNCH_TIME_VARIABLE in os.environ:
        return float(os.environ[LAUNCH_TIME_VARIABLE])
    try:
        import psutil

        return psutil.Process(os.getpid()).create_time()
    except Exception:  # psutil missing or /proc unreadable: fall back to now
        return time.time()
