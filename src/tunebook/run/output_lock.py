"""One run per output directory: an exclusive lock held for the run's lifetime.

Two runs writing into one `output_dir` both train, interleave their `metrics.jsonl` lines and overwrite each other's
checkpoints and model. The main process therefore holds an advisory lock on `output_dir/.tunebook.lock` from the
run's start to its end; a second run stops at start-up with one line naming the holder's PID and host.

The lock is `flock(2)` on an open file, so the kernel releases it whenever its holder dies, however it dies (`kill -9`,
a node lost): a lock is never stale after its holder's death, and there is no PID to check and no file to clean up.
The file itself stays, holding the last holder's PID, host and start time, which is what the refusal quotes. On NFS,
Linux implements `flock` with the server's byte-range locks, which every client sees.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path

from ..errors import ConfigError

__all__ = ["LOCK_NAME", "OutputDirLock", "lock_output_dir", "lock_run_output_dir"]

LOCK_NAME = ".tunebook.lock"

# Locks this process holds, by resolved directory: a notebook's run that failed before releasing its lock leaves it
# held (its frames keep the file open), and the next run of the same process may take it over, since one process
# trains one run at a time.
_HELD: dict[Path, OutputDirLock] = {}


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
    """An exclusive `flock` on `output_dir/.tunebook.lock`; `release()` (idempotent) gives it up."""

    def __init__(self, directory: Path, fd: int | None):
        self.directory = directory
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

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
    _make_directory(directory)
    key = directory.resolve()
    if key in _HELD:  # this process's earlier run, which ended without releasing it
        _HELD.pop(key).release()
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX (Windows): no advisory lock to take
        return OutputDirLock(key, None)
    path = directory / LOCK_NAME
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
    lock = OutputDirLock(key, fd)
    _HELD[key] = lock
    return lock


def lock_run_output_dir(accelerator, output_dir: str | Path, recipe: str) -> OutputDirLock:
    """`lock_output_dir` on the main process; every process of the launch stops with its line if it fails (the
    others learn it by a broadcast, so none goes on to prepare data for a run that is not happening)."""
    from ..distributed import decided_by_main

    held: list[OutputDirLock] = []  # the lock stays with the main process: only the verdict is broadcast
    decided_by_main(accelerator, lambda: held.append(lock_output_dir(output_dir, recipe)))
    return held[0] if held else OutputDirLock(Path(output_dir), None)


def _make_directory(directory: Path) -> None:
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
