"""One run per output directory: an exclusive lock held for the run's lifetime.

Two runs writing into one `output_dir` both train, interleave their `metrics.jsonl` lines and overwrite each other's
checkpoints and model. The main process therefore holds an advisory lock on `output_dir/.tunebook.lock` from the
run's start to its end; a second run stops at start-up with one line naming the holder's PID and host.

The lock is `flock(2)` on an open file, so the kernel releases it whenever its holder dies, however it dies (`kill -9`,
a node lost): a lock is never stale after its holder's death, and there is no PID to check and no file to clean up.
The file itself stays, holding the last holder's PID, host and start time, which is what the refusal quotes. On NFS,
Linux implements `flock` with the server's byte-range locks, which every client sees.

A start that fails (a malformed row, a model that does not build) writes nothing: what the lock created (the folder,
the lock file) is removed again unless the run reached `started()` (`start_training`), when a command's process ends
or when the process takes its next lock (a notebook's next run), since one process trains one run at a time.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import socket
import time
from pathlib import Path

from ..errors import ConfigError, owns_process

__all__ = ["LOCK_NAME", "OutputDirLock", "lock_output_dir", "lock_run_output_dir"]

LOCK_NAME = ".tunebook.lock"

# Locks this process holds, by resolved directory: a notebook's run that failed before releasing its lock leaves it
# held (its frames keep the file open), and the next run of the same process may take it over, since one process
# trains one run at a time.
_HELD: dict[Path, OutputDirLock] = {}
_EXIT_HOOK: list = []  # `_abandon_held`, once a command's process has registered it


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) shares its parent's lock through the inherited descriptor: it closes its
    copy, so the lock ends with the run's process, not with its last worker, and never unlocks it (an unlock from
    the child would release the parent's lock: they share one open file)."""
    for lock in _HELD.values():
        if lock._fd is not None:
            os.close(lock._fd)
            lock._fd = None
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class OutputDirLock:
    """An exclusive `flock` on `output_dir/.tunebook.lock`; `release()` (idempotent) gives it up, and `abandon()`
    also removes what taking it created, unless `started()` said the run has begun to write."""

    def __init__(
        self, directory: Path, fd: int | None, made_file: Path | None = None, made_dirs: tuple[Path, ...] = ()
    ):
        self.directory = directory
        self._fd = fd
        self._made_file = made_file  # the lock file, if taking the lock created it
        self._made_dirs = made_dirs  # the folders taking it created, innermost first
        self._started = False

    @property
    def held(self) -> bool:
        return self._fd is not None

    def started(self) -> None:
        """The run begins to write into the folder (`start_training`): from now on it is the run's, kept if it fails."""
        self._started = True

    def abandon(self) -> None:
        """Release; and if the run never started, remove the lock file and the folders the lock created (when they
        hold nothing else): a failed start leaves the file system as it found it."""
        if not self._started and self._made_file is not None and self.held:
            # Unlinked while still held: a run that opened the file before would be refused by the lock, one that
            # opens it after creates a new file, so no two runs ever hold locks on two files of one folder.
            with contextlib.suppress(OSError):
                self._made_file.unlink()
        self.release()
        if not self._started:
            for folder in self._made_dirs:
                with contextlib.suppress(OSError):  # a folder something else wrote into is not empty: it stays
                    folder.rmdir()
        self._made_file, self._made_dirs = None, ()

    def release(self) -> None:
        if self._fd is None:
            return
        import fcntl

        fd, self._fd = self._fd, None
        _HELD.pop(self.directory, None)
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> OutputDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_output_dir(output_dir: str | Path, recipe: str = "") -> OutputDirLock:
    """Create `output_dir` if needed and lock it for this run, or stop with one line.

    Raises `ConfigError` when another live process holds the lock (naming its PID, host and start), when
    `output_dir` (or a folder above it) is a file, or when it cannot be written (a read-only file system,
    permissions)."""
    directory = Path(output_dir).expanduser()
    # This process's earlier run that ended without releasing its lock (a notebook's run that failed, its frames
    # held by the traceback): one process trains one run at a time, so it is over; a start that failed is undone.
    for earlier in list(_HELD.values()):
        earlier.abandon()
    made = _make_directory(directory)
    key = directory.resolve()
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX (Windows): no advisory lock to take
        return OutputDirLock(key, None)
    path = directory / LOCK_NAME
    new_file = not path.exists()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise ConfigError(f"output_dir {directory} cannot be written: {_reason(error)} ({path})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        holder = _read_holder(fd)
        os.close(fd)
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ConfigError(f"output_dir {directory}: cannot lock {path}: {_reason(error)}") from None
        raise ConfigError(
            f"output_dir {directory} is in use by another run ({holder}); wait for it to end, or choose another "
            "output_dir"
        ) from None
    _write_holder(fd, recipe)
    lock = OutputDirLock(key, fd, path if new_file else None, tuple(made))
    if owns_process() and not _EXIT_HOOK:  # a command's process only: a caller's interpreter keeps its atexit list
        _EXIT_HOOK.append(atexit.register(_abandon_held))
    _HELD[key] = lock
    return lock


def _abandon_held() -> None:
    """At a command's exit: a run whose start failed (its exception ends the process) leaves no folder behind."""
    for lock in list(_HELD.values()):
        lock.abandon()


def lock_run_output_dir(accelerator, output_dir: str | Path, recipe: str) -> OutputDirLock:
    """`lock_output_dir` on the main process; every process of the launch stops with its line if it fails (the
    others learn it by a broadcast, so none goes on to prepare data for a run that is not happening)."""
    from ..distributed import decided_by_main

    held: list[OutputDirLock] = []  # the lock stays with the main process: only the verdict is broadcast
    decided_by_main(accelerator, lambda: held.append(lock_output_dir(output_dir, recipe)))
    return held[0] if held else OutputDirLock(Path(output_dir), None)


def _make_directory(directory: Path) -> list[Path]:
    """Create `directory` (and its missing parents); returns the folders it created, innermost first."""
    missing = [p for p in [directory, *directory.parents] if not p.exists()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in [directory, *directory.parents] if p.exists() and not p.is_dir()), directory)
        where = f"output_dir {directory}" if blocker == directory else f"output_dir {directory}: {blocker}"
        raise ConfigError(f"{where} is a file, not a directory") from None
    except OSError as error:
        raise ConfigError(f"output_dir {directory} cannot be created: {_reason(error)}") from None
    if not directory.is_dir():  # mkdir(exist_ok=True) passes over an existing file on some Pythons
        raise ConfigError(f"output_dir {directory} is a file, not a directory")
    return missing


def _reason(error: OSError) -> str:
    if error.errno == errno.EROFS:
        return "read-only file system"
    if error.errno == errno.ENOSPC:
        return "no space left on device"
    if error.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return error.strerror or str(error)


def _write_holder(fd: int, recipe: str) -> None:
    """Who holds the lock, for the message a second run shows (best effort: the lock is what counts)."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": started, "recipe": recipe}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    except OSError:
        pass


def _read_holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        record = {}
    if not isinstance(record, dict) or "pid" not in record:
        return "its PID and host were not recorded"
    what = f"{record.get('recipe')} run, " if record.get("recipe") else ""
    return f"{what}PID {record['pid']} on host {record.get('host', '?')}, started {record.get('started', '?')}"
