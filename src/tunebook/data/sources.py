"""Load training data from local json/jsonl/csv/parquet files or folders, or Hub data set names.

A source spec is a path or name string, or a list of such strings or of `{path: ..., weight: ...}` /
`{path: ..., samples: ...}` mappings. A weight is a multiple of that source's rows: 0.5 takes a seeded half,
2.0 repeats it twice. `samples` is a count of rows instead: fewer than the source has takes a seeded subset,
more repeats it whole and tops up with a seeded subset. Both are deterministic for a seed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import datasets

from ..errors import DataError, first_line

__all__ = ["DataSource", "config_sources", "fingerprint_sources", "load_source", "parse_sources"]

EXTENSIONS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


@dataclass(frozen=True)
class DataSource:
    path: str
    weight: float = 1.0
    samples: int | None = None  # a row count; replaces weight when set

    @property
    def is_local(self) -> bool:
        return (
            Path(self.path).expanduser().exists()
            or self.path.startswith((".", "/", "~"))
            or (Path(self.path).suffix in EXTENSIONS)
        )


def parse_sources(spec: str | list | None, key: str) -> list[DataSource]:
    """Turn a config value into sources; `key` names the config key in errors."""
    if spec is None:
        return []
    items = spec if isinstance(spec, list) else [spec]
    if not items:
        raise DataError(f"{key} is an empty list")
    sources = []
    for item in items:
        if isinstance(item, str):
            sources.append(DataSource(item))
        elif isinstance(item, dict) and set(item) <= {"path", "weight", "samples"} and "path" in item:
            if "weight" in item and "samples" in item:
                raise DataError(f"{key}: give '{item['path']}' a weight or a samples count, not both")
            try:
                weight = float(item.get("weight", 1.0))
                samples = None if item.get("samples") is None else int(item["samples"])
            except (TypeError, ValueError):
                raise DataError(
                    f"{key}: weight and samples of '{item['path']}' must be numbers, got {item!r}"
                ) from None
            if weight <= 0 or (samples is not None and samples < 1):
                raise DataError(f"{key}: weight/samples of '{item['path']}' must be > 0, got {item!r}")
            sources.append(DataSource(str(item["path"]), weight, samples))
        else:
            raise DataError(
                f"{key}: each entry must be a path, {{path: ..., weight: ...}} or {{path: ..., samples: ...}}, "
                f"got {item!r}"
            )
    return sources


def _local_files(source: DataSource) -> list[Path]:
    path = Path(source.path).expanduser()
    if not path.exists():
        raise DataError(f"data file or folder not found: {source.path}")
    if path.is_file():
        if path.suffix not in EXTENSIONS:
            raise DataError(f"{path}: unsupported data file type '{path.suffix}' (use {', '.join(EXTENSIONS)})")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in EXTENSIONS)
    if not files:
        raise DataError(f"data folder {path} has no {'/'.join(EXTENSIONS)} files")
    kinds = {EXTENSIONS[p.suffix] for p in files}
    if len(kinds) > 1:
        raise DataError(f"data folder {path} mixes file types ({', '.join(sorted(kinds))}); use one type per folder")
    return files


def config_sources(config, cache_dir: Path, write_synthetic) -> tuple[list[DataSource], list[DataSource]]:
    """A recipe config's (train, eval) sources; with no `train_data`, the recipe's generated task:
    `write_synthetic(directory, num_train, num_eval, seed)` writes it and returns (train path, eval path)."""
    train = parse_sources(config.train_data, "train_data")
    evaluation = parse_sources(config.eval_data, "eval_data")
    if not train:
        train_path, eval_path = write_synthetic(
            Path(cache_dir) / "synthetic", config.synthetic_train_size, config.synthetic_eval_size, config.seed
        )
        train = parse_sources(str(train_path), "train_data")
        evaluation = evaluation or parse_sources(str(eval_path), "eval_data")
    return train, evaluation


def fingerprint_sources(sources: list[DataSource]) -> str:
    """Hash of the local files' contents (and Hub names) and weights: what tokenised caches depend on."""
    h = hashlib.sha256()
    for source in sources:
        h.update(f"{source.path}|{source.weight}|{source.samples}\n".encode())
        if source.is_local:
            for path in _local_files(source):
                with open(path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 22), b""):
                        h.update(chunk)
    return h.hexdigest()


def load_source(
    source: DataSource, cache_dir: str | Path, seed: int, text_sample_by: str = "paragraph"
) -> datasets.Dataset:
    """Load one source as a memory-mapped `datasets.Dataset` and apply its weight.

    A `.txt` file becomes a `text` column with one row per `text_sample_by`: document (the whole file), paragraph
    (text between blank lines) or line.
    """
    if source.is_local:
        files = _local_files(source)
        builder = EXTENSIONS[files[0].suffix]
        options = {"sample_by": text_sample_by} if builder == "text" else {}
        try:
            dataset = datasets.load_dataset(
                builder, data_files=[str(p) for p in files], split="train", cache_dir=str(Path(cache_dir) / "raw"),
                **options,
            )  # fmt: skip
        except Exception as e:  # datasets wraps parser errors; find the file and line ourselves
            for path in files:
                _raise_if_malformed(path)
            raise DataError(f"could not read {source.path}: {first_line(e)}") from None
    else:
        try:
            dataset = datasets.load_dataset(source.path, split="train", cache_dir=str(Path(cache_dir) / "raw"))
        except Exception as e:
            raise DataError(
                f"data set '{source.path}' is not a local file or folder and could not be loaded from the Hub: "
                f"{first_line(e)}"
            ) from None
    if source.samples is not None:
        return _take_rows(dataset, source.samples, seed)
    return _take_rows(dataset, int(round(source.weight * len(dataset))), seed)


def _take_rows(dataset: datasets.Dataset, count: int, seed: int) -> datasets.Dataset:
    """`count` rows: whole copies of the data set, then a seeded subset of it for the remainder."""
    if count == len(dataset) or len(dataset) == 0:
        return dataset
    whole, rest = divmod(count, len(dataset))
    parts = [dataset] * whole
    if rest:
        parts.append(dataset.shuffle(seed=seed).select(range(rest)))
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def _raise_if_malformed(path: Path) -> None:
    """Raise a DataError naming the file and line of the first syntax error, if there is one."""
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}, line {lineno}: malformed JSON: {e.msg}") from None
                if not isinstance(row, dict):
                    raise DataError(
                        f"{path}, line {lineno}: each line must be a JSON object, got {type(row).__name__}"
                    )
    elif path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}, line {e.lineno}: malformed JSON: {e.msg}") from None
        if not isinstance(data, list | dict):
            raise DataError(f"{path}: expected a JSON array of objects, got {type(data).__name__}")
    elif path.suffix == ".csv":
        import csv

        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise DataError(f"{path}: empty CSV file")
            for row in reader:
                if row and len(row) != len(header):
                    raise DataError(
                        f"{path}, line {reader.line_num}: {len(row)} fields where the header has {len(header)}"
                    )
