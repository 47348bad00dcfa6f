"""Fingerprinted, memory-mapped Arrow caches of prepared data sets.

A prepared data set is saved under `<cache_dir>/prepared/<fingerprint>/` and loaded back memory-mapped, so
a second run with the same inputs does no tokenisation. The fingerprint covers everything the result depends
on (data file contents, tokenizer files, template, lengths, preprocessing version), so changing any of them
builds a new entry. Entries are written to a temporary folder and renamed into place when complete: a run
killed mid-build never leaves an entry that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from ..locations import default_cache_dir
from ..preparation import preparation_lock

__all__ = ["PREPROCESSING_VERSION", "cached_dataset", "default_cache_dir", "fingerprint", "tokenizer_fingerprint"]

# Bump when tokenisation or masking changes what it produces, so old caches are not reused.
PREPROCESSING_VERSION = "2"  # 2: a prompt/completion row's loss is on its completion only
STATS_FILE = "tunebook_stats.json"


def fingerprint(parts: dict[str, Any]) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of the files `save_pretrained` writes: vocabulary, merges, special tokens and chat template."""
    h = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():
                h.update(path.name.encode())
                content = path.read_bytes()
                if path.name == "tokenizer.json":
                    # Calling a fast tokenizer with truncation/padding leaves that state in its backend, and
                    # save_pretrained writes it: without this the same tokenizer hashed differently after it had
                    # tokenised the training split, and the eval split was tokenised again on the next run.
                    spec = json.loads(content)
                    spec["truncation"] = spec["padding"] = None
                    content = json.dumps(spec, sort_keys=True).encode()
                h.update(content)
    h.update(str(tokenizer.chat_template).encode())
    return h.hexdigest()


def cached_dataset(
    cache_dir: str | Path, key: str, build: Callable[[Path], tuple[datasets.Dataset, dict[str, Any]]]
) -> tuple[datasets.Dataset, dict[str, Any], bool]:
    """Load the entry `key`, or build, save and load it. Returns (dataset, stats, was_cached).

    `build(scratch)` gets a scratch folder for its intermediate Arrow files (mapped, filtered, reordered data),
    deleted once the entry is saved, so a build leaves only the entry behind. The lookup and the build hold the
    entry's lock (`tunebook.preparation.preparation_lock`, keyed by `key`): of the processes that need this entry
    the first builds it and the others then find it finished and only map its files, while runs that need other
    entries of the same cache go on.
    """
    with preparation_lock(cache_dir, key, f"prepared data {key}"):
        return _load_or_build(Path(cache_dir), key, build)


def _load_or_build(cache_dir: Path, key: str, build) -> tuple[datasets.Dataset, dict[str, Any], bool]:
    entry = cache_dir / "prepared" / key
    if (entry / STATS_FILE).is_file():
        return datasets.load_from_disk(str(entry)), json.loads((entry / STATS_FILE).read_text()), True
    (cache_dir / "tmp").mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=cache_dir / "tmp"))
    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    try:
        dataset, stats = build(scratch)
        shutil.rmtree(tmp, ignore_errors=True)
        dataset.save_to_disk(str(tmp))
        (tmp / STATS_FILE).write_text(json.dumps(stats, indent=2))
        del dataset  # release the scratch files' memory maps before deleting them
        try:
            tmp.rename(entry)
        except OSError:  # built concurrently by another run: theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return datasets.load_from_disk(str(entry)), stats, False
