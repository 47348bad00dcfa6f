"""A checkpoint's manifest: every file's size and checksum, so a damaged checkpoint is found before it is loaded.

`save_checkpoint` writes `manifest.json` last, inside `step-<N>.tmp`, once every process has written its part and
before the rename, so a complete checkpoint always has one. `verify_checkpoint` compares the files against it:
sizes first (a truncated or deleted file is found without reading anything), then checksums. The checksum is
xxHash's XXH3 (64 bits, the `xxhash` package `datasets` needs too): not cryptographic, it finds damage, not
tampering; at about 6 GB/s on one core it is 4x zlib's CRC-32 and faster than the files are read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path, PurePosixPath

from ..errors import first_line
from ..locations import MANIFEST

__all__ = ["MANIFEST", "manifest_bytes", "verify_checkpoint", "write_manifest"]

CHECKSUM = "xxh3_64"
CHUNK = 8 << 20  # bytes read at a time: large enough that the per-call cost is nothing, small enough to stay cached


def write_manifest(directory: Path) -> int:
    """Write `directory/manifest.json` over every file below `directory`; return their total size in bytes."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[path.relative_to(directory).as_posix()] = {"size": path.stat().st_size, CHECKSUM: _checksum(path)}
    total = sum(entry["size"] for entry in files.values())
    manifest = {"format": 1, "checksum": CHECKSUM, "total_bytes": total, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return total


def manifest_bytes(checkpoint: Path) -> int | None:
    """The total size of `checkpoint`'s files as its manifest records it, or None without a readable manifest."""
    try:
        return int(json.loads((checkpoint / MANIFEST).read_text())["total_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def verify_checkpoint(checkpoint: Path, log: logging.Logger) -> str | None:
    """What is wrong with `checkpoint`'s files against its manifest, in a few words; None when every file is there
    with its size and checksum. A checkpoint without a manifest (written by a Tunebook from before manifests) is
    accepted with a warning that it is not verified: refusing it would strand every run saved before, and its
    files are still read by loaders that fail loudly (the RNG states included: `checkpoint.load_rng_state`)."""
    if not (checkpoint / MANIFEST).is_file():
        log.warning("%s has no %s (saved by an earlier Tunebook): its files are not verified", checkpoint, MANIFEST)
        return None
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        entries = [(name, int(e["size"]), e[manifest["checksum"]]) for name, e in manifest["files"].items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"unreadable {MANIFEST} ({first_line(error)})"
    if manifest["checksum"] != CHECKSUM:
        return f"unreadable {MANIFEST} (unknown checksum {manifest['checksum']!r})"
    if any(PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts for name, _, _ in entries):
        return f"unreadable {MANIFEST} (a path outside the checkpoint)"
    for name, size, _ in entries:  # sizes first: truncation and deletion are found without reading a byte
        path = checkpoint / name
        if not path.is_file():
            return f"missing file {name}"
        if path.stat().st_size != size:
            return f"size of {name} is {path.stat().st_size} bytes, the manifest says {size}"
    for name, _, digest in entries:
        try:
            if _checksum(checkpoint / name) != digest:
                return f"checksum mismatch of {name}"
        except OSError as error:
            return f"unreadable file {name} ({first_line(error)})"
    return None


def _checksum(path: Path) -> str:
    import xxhash

    digest, buffer = xxhash.xxh3_64(), bytearray(min(CHUNK, path.stat().st_size) or 1)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()
