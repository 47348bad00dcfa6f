"""The lock of a cache entry: of the processes that need the same prepared data or trained tokenizer, the first builds
it and the others wait, then map what it wrote (the first rule of `tunebook.distributed`). A module of its own, below
the data path and the tokenizer set-up that take it and the launch checks that explain it: neither imports the other.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

__all__ = ["preparation_lock"]

logger = logging.getLogger("tunebook")


@contextmanager
def preparation_lock(cache_dir: str | Path, key: str, what: str = "data"):
    """Hold the lock of the cache entry `key` (its fingerprint) in `cache_dir` while looking for it and building it:
    of the processes that need the same entry, the first builds it and the others wait, then map what it wrote.

    One lock file per entry, not one per cache: a run that builds slowly (a large data set, a pathological row) holds
    up only the runs that need what it builds. A file lock, not a collective: waiting for another process's
    tokenisation has no timeout. On a shared file system the lock also orders the nodes; with node-local caches each
    node prepares its own copy, and the preflight check then verifies that all copies hold the same data.
    """
    from filelock import FileLock, Timeout

    path = Path(cache_dir).expanduser() / "locks" / f"{key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=2)
    except Timeout:
        logger.info("Waiting for another process to finish building %s in %s (lock: %s)", what, cache_dir, path)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
