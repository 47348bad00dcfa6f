"""Prepared shards: a data set tokenised (and packed) once by `tunebook prepare --output`, written as Arrow shards with
its tokenizer and what made it, streamed by any number of nodes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

from ...errors import ConfigError
from ...models.tokenizer import load_tokenizer
from ..cache import tokenizer_fingerprint
from ..sources import DataSource

__all__ = ["PREPARED", "PREPARED_TOKENIZER", "ROW_COLUMNS", "prepared_meta", "prepared_tokenizer",
           "write_prepared_shards"]  # fmt: skip

# A folder of prepared shards (`tunebook prepare --output`): what made them, and its tokenizer. Names starting with
# "_" are not read as data files (tunebook.data.sources).
PREPARED = "_tunebook_prepared.json"
PREPARED_TOKENIZER = "_tokenizer"
ROW_COLUMNS = ("input_ids", "labels", "seq_lengths")  # what a prepared row holds


def prepared_meta(source: DataSource) -> dict[str, Any] | None:
    """What `tunebook prepare --output` recorded in a folder of prepared shards; None for other sources."""
    path = Path(source.path).expanduser() / PREPARED
    return json.loads(path.read_text()) if source.is_local and path.is_file() else None


def prepared_tokenizer(sources: list[DataSource], config, recipe: str):
    """The tokenizer of streamed prepared shards, checked against the run: the shards' own unless the config names
    one (which must then be the same); None when the sources are not prepared shards."""
    metas = [prepared_meta(s) for s in sources]
    if not all(metas):
        return None
    for source, meta in zip(sources, metas):
        made = {"recipe": recipe, "max_seq_length": config.max_seq_length, "packing": getattr(config, "packing", True)}
        for key, value in made.items():
            if meta[key] != value:
                raise ConfigError(f"{source.path} was prepared with {key} {meta[key]!r} and this run has {value!r}; "
                                  f"set {key}: {meta[key]!r}, or prepare it again")  # fmt: skip
    named = config.tokenizer_name_or_path or config.model_name_or_path
    tokenizer = load_tokenizer(named or str(Path(sources[0].path).expanduser() / PREPARED_TOKENIZER),
                               config.trust_remote_code)  # fmt: skip
    for source, meta in zip(sources, metas):
        if meta["tokenizer"] != tokenizer_fingerprint(tokenizer):
            raise ConfigError(f"{source.path} was tokenised with another tokenizer than {named}; use the one saved "
                              f"with the shards ({source.path}/{PREPARED_TOKENIZER}), or prepare it again")  # fmt: skip
    return tokenizer


def write_prepared_shards(dataset: datasets.Dataset, tokenizer, output: Path, num_shards: int, meta: dict) -> list:
    """`dataset`'s rows as `num_shards` Arrow files in `output` (each written whole, then renamed into place), the
    tokenizer and what made them: a folder any number of nodes stream with `{path: output, streaming: true}`."""
    import pyarrow as pa

    if not 1 <= num_shards <= len(dataset):
        raise ConfigError(f"--num_shards {num_shards}: must be between 1 and the {len(dataset)} rows prepared")
    output.mkdir(parents=True, exist_ok=True)
    for old in output.glob("train-*-of-*.arrow"):
        old.unlink()
    dataset = dataset.select_columns([c for c in ROW_COLUMNS if c in dataset.column_names])
    paths = []
    for index in range(num_shards):
        table = dataset.shard(num_shards, index, contiguous=True).with_format("arrow")[:]
        path = output / f"train-{index:05d}-of-{num_shards:05d}.arrow"
        tmp = path.with_name(f".{path.name}.tmp")
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=1000)  # record batches a reader can resume between
        tmp.rename(path)
        paths.append(path)
    tokenizer.save_pretrained(output / PREPARED_TOKENIZER)
    (output / PREPARED).write_text(json.dumps({**meta, "tokenizer": tokenizer_fingerprint(tokenizer),
                                               "num_shards": num_shards, "rows": len(dataset)}, indent=2))  # fmt: skip
    return paths
