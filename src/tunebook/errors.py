"""User-facing errors: one readable message that names the file, line, key or value at fault.

Anything a user can cause (a typo in a config, a malformed data file, a missing model path) is raised as a
`TunebookError`. A Tunebook command (the `tunebook` console script, a recipe run as a script) calls
`enter_command_line()`, which installs `install_excepthook()` so these print as one line instead of a traceback;
anything else is a bug in Tunebook or a library and keeps its full traceback. Importing Tunebook or calling a recipe's
`main(config)` from Python leaves the process's hooks as they were; in a notebook the errors still show as one line,
through IPython's own protocol for an exception's display (`_render_traceback_`).
"""

from __future__ import annotations

import io
import os
import re
import sys
import traceback

__all__ = [
    "ConfigError",
    "DataError",
    "ModelError",
    "TrainingError",
    "TunebookError",
    "enter_command_line",
    "first_line",
    "install_excepthook",
    "owns_process",
    "same_on_every_rank",
]


# How torch re-raises an error met in a DataLoader worker (`torch._utils.ExceptionWrapper.reraise`): the same class,
# built from one string, "Caught DataError in DataLoader worker process 0.\nOriginal Traceback ...", the worker's whole
# traceback, which ends with the error's own line "tunebook.errors.DataError: <message>".
_WORKER_ERROR = re.compile(r"Caught \w+ in DataLoader worker process \d+\.\nOriginal Traceback")


class TunebookError(Exception):
    """A mistake in the user's input, reported without a traceback."""

    def __init__(self, *args):
        # A data error met in a loader's worker (an image that no longer decodes) stays the one line it was there;
        # the worker's traceback, which says nothing the message does not, is kept aside.
        if len(args) == 1 and isinstance(args[0], str) and _WORKER_ERROR.match(args[0]):
            self.worker_traceback = args[0]
            args = (args[0].rstrip().splitlines()[-1].split(": ", 1)[-1],)
        super().__init__(*args)

    def _render_traceback_(self) -> list[str]:
        """IPython's (Jupyter's) hook for an exception's own display: the one line instead of a page of traceback,
        with nothing of the kernel's changed (no custom handler installed on its shell). IPython asks twice (its
        traceback, then the kernel's error reply): printed once."""
        if not getattr(self, "_shown_in_ipython", False):
            self._shown_in_ipython = True
            print(f"tunebook: error: {self}", file=sys.stderr, flush=True)
        return []


class ConfigError(TunebookError):
    """An unknown key, a value of the wrong type, or an impossible combination of settings."""


class DataError(TunebookError):
    """A data file that is missing, malformed, lacks columns, or leaves nothing to train on."""


class ModelError(TunebookError):
    """A model or tokenizer that cannot be found or built."""


class TrainingError(TunebookError):
    """Training cannot go on (a non-finite loss under nan_policy: stop); the message says what was kept."""


def same_on_every_rank(error: TunebookError) -> TunebookError:
    """Mark an error every process of a machine meets alike (a config typo, a malformed data file): only the
    machine's first process prints it, instead of one identical line per process."""
    error.same_on_every_rank = True
    return error


# Whether a Tunebook command owns this process (`enter_command_line`): only then is process-wide state Tunebook's to set.
_COMMAND_LINE = [False]


def enter_command_line() -> None:
    """Mark this process as a Tunebook command's (the `tunebook` console script, or a recipe's `__main__` reading
    `sys.argv`): user errors print as one line (`install_excepthook`), and `setup_logging` formats the root logger,
    so the libraries' records and Python's warnings share Tunebook's format. A caller in Python gets neither."""
    _COMMAND_LINE[0] = True
    install_excepthook()


def owns_process() -> bool:
    """Whether `enter_command_line` was called: this process is a Tunebook command, not a caller's interpreter."""
    return _COMMAND_LINE[0]


def install_excepthook() -> None:
    """Print `TunebookError`s as `tunebook: error: ...` and exit non-zero; leave other errors alone.

    In an IPython kernel (Jupyter) they show as one line without it: `TunebookError._render_traceback_`.
    """
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, TunebookError):
            if _should_print(exc):
                # torch.distributed wraps the excepthook to prefix every line with "[rankN]: " through a StringIO;
                # the message names its rank already, so it goes straight to the real stderr.
                stream = sys.__stderr__ if isinstance(sys.stderr, io.StringIO) else sys.stderr
                print(f"tunebook: error{_rank_prefix()}: {exc}", file=stream, flush=True)
            # Release what the failed frames held (data loaders and their worker processes) before exit.
            traceback.clear_frames(tb)
            return
        previous(exc_type, exc, tb)

    if getattr(sys.excepthook, "_tunebook", False):
        return
    hook._tunebook = True
    sys.excepthook = hook


def _should_print(error: BaseException) -> bool:
    return not getattr(error, "same_on_every_rank", False) or os.environ.get("LOCAL_RANK", "0") == "0"


def _rank_prefix() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f" (rank {os.environ.get('RANK', '0')})" if world > 1 else ""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message: library errors are often pages long."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
