"""User-facing errors: one readable message that names the file, line, key or value at fault.

Anything a user can cause (a typo in a config, a malformed data file, a missing model path) is raised as a
`TunebookError`. Recipes install `install_excepthook()` so these print as one line instead of a traceback;
anything else is a bug in Tunebook or a library and keeps its full traceback.
"""

from __future__ import annotations

import sys
import traceback

__all__ = [
    "ConfigError",
    "DataError",
    "ModelError",
    "TrainingError",
    "TunebookError",
    "first_line",
    "install_excepthook",
]


class TunebookError(Exception):
    """A mistake in the user's input, reported without a traceback."""


class ConfigError(TunebookError):
    """An unknown key, a value of the wrong type, or an impossible combination of settings."""


class DataError(TunebookError):
    """A data file that is missing, malformed, lacks columns, or leaves nothing to train on."""


class ModelError(TunebookError):
    """A model or tokenizer that cannot be found or built."""


class TrainingError(TunebookError):
    """Training cannot go on (a non-finite loss under nan_policy: stop); the message says what was kept."""


def install_excepthook() -> None:
    """Print `TunebookError`s as `tunebook: error: ...` and exit non-zero; leave other errors alone."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, TunebookError):
            rank = _rank_prefix()
            print(f"tunebook: error{rank}: {exc}", file=sys.stderr, flush=True)
            # Release what the failed frames held (data loaders and their worker processes) before exit.
            traceback.clear_frames(tb)
            return
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def _rank_prefix() -> str:
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f" (rank {os.environ.get('RANK', '0')})" if world > 1 else ""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message: library errors are often pages long."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
