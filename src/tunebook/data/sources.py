"""Load training data: local files and folders, `save_to_disk` folders, Hub data sets, by split, renamed, weighted.

A source spec is a path or Hub name, or a mapping (`DataSource`'s fields):

    train_data: HuggingFaceH4/ultrachat_200k                     # a Hub name (one split, or name it:)
    train_data: {path: HuggingFaceH4/ultrachat_200k, split: train_sft, revision: main}
    train_data: {path: data/, split: test}                       # a folder read as datasets.load_dataset reads it
    train_data: [{path: a.jsonl, weight: 0.5}, {path: b.csv, samples: 2000, columns: {question: prompt}}]
    train_data: [{path: corpus/, streaming: true, weight: 0.8}, {path: code/, streaming: true, weight: 0.2}]

A file is one split, `train`. A folder is read the way `datasets.load_dataset` reads it: split names from file and
folder names (`train.jsonl`/`test.jsonl`, `data/train_sft-00000-of-00001.parquet`, `train/`), a README's `configs`,
a Hub cache snapshot; a `save_to_disk` folder with `load_from_disk`. A folder or Hub data set with several splits
needs `split`: they are never merged. `columns` renames columns before the format is detected. `weight` is a multiple
of the rows (0.5 a seeded half, 2.0 twice), `samples` a row count (a seeded subset, or whole copies then a subset).
`streaming: true` reads the source as it trains instead of caching it first (`tunebook.data.stream`); a streamed
source's `weight` is its share of a mixture's rows. `format: label_text` reads a file of `<label> <text>` lines
(SST-2's `stsa.binary.train`, and many classic classification files, whatever their names end with) into the
columns `label` and `text`: a label of digits as a number, any other as its name.

CSV and TSV cells are read as text, exactly as written: `0043` stays `0043` and `NA`, `null` or an empty cell stay
what they are (pandas would guess numbers and missing values). JSON values arrive as written too: a column whose type
varies from row to row (a number among strings) keeps each row's value, `"0000"` a string and `7` a number. Text files
must be UTF-8: a byte sequence that is not is reported by file, line and column.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

from ..errors import DataError, first_line
from ..locations import looks_like_local_data
from .files import (
    EXTENSIONS,
    builder_of,
    file_ending,
    holds_json,
    json_as_written,
    raise_if_malformed,
    raise_if_not_utf8,
    reader_options,
)

__all__ = [
    "DataSource",
    "config_sources",
    "fingerprint_sources",
    "load_source",
    "parse_sources",
    "raise_unless_text",
    "suggested_split",
]

KEYS = ("path", "name", "split", "revision", "data_files", "data_dir", "columns", "weight", "samples", "streaming",
        "format")  # fmt: skip
FORMATS = ("label_text",)  # how a file is read whatever its name ends with (`format`)
SAVED_DATASET_FILES = ("dataset_dict.json", "state.json")  # what save_to_disk writes


@dataclass(frozen=True)
class DataSource:
    """One entry of `train_data`/`eval_data`. `data_files` and `columns` are kept as JSON text (hashable)."""

    path: str
    name: str | None = None  # the data set's config ("subset" on the Hub)
    split: str | None = None
    revision: str | None = None  # a Hub branch, tag or commit
    data_files: str | None = None  # JSON of datasets.load_dataset's data_files
    data_dir: str | None = None
    columns: str | None = None  # JSON of a rename map, e.g. {"conversations": "messages"}
    weight: float = 1.0
    samples: int | None = None  # a row count; replaces weight when set
    # Out of the repr, which cache fingerprints hash: adding the key must not invalidate every existing cache.
    streaming: bool = field(default=False, repr=False)
    # The config key it was given in, for messages (which split to suggest): no part of what the source reads.
    key: str = field(default="train_data", repr=False, compare=False)
    format: str | None = field(default=None, repr=False)  # hashed by fingerprint_sources when set

    @property
    def is_local(self) -> bool:
        return looks_like_local_data(self.path)

    @property
    def where(self) -> str:
        """How errors name the source: its path, with the split when one was named."""
        return f"{self.path} (split {self.split})" if self.split else self.path

    @property
    def renames(self) -> dict[str, str]:
        return json.loads(self.columns) if self.columns else {}


def parse_sources(spec: str | list | dict | None, key: str) -> list[DataSource]:
    """Turn a config value into sources; `key` names the config key in errors."""
    if spec is None:
        return []
    items = spec if isinstance(spec, list) else [spec]
    if not items:
        raise DataError(f"{key} is an empty list")
    return [_parse_one(item, key) for item in items]


def _parse_one(item: Any, key: str) -> DataSource:
    if isinstance(item, str):
        return DataSource(item, key=key)
    if not isinstance(item, dict) or "path" not in item or set(item) - set(KEYS):
        unknown = sorted(set(item) - set(KEYS)) if isinstance(item, dict) else []
        hint = f" (unknown keys {unknown}; a source takes {', '.join(KEYS)})" if unknown else ""
        raise DataError(f"{key}: each entry must be a path or a mapping with a 'path', got {item!r}{hint}")
    path = str(item["path"])
    if "weight" in item and "samples" in item:
        raise DataError(f"{key}: give '{path}' a weight or a samples count, not both")
    try:
        weight = float(item.get("weight", 1.0))
        samples = None if item.get("samples") is None else int(item["samples"])
    except (TypeError, ValueError):
        raise DataError(f"{key}: weight and samples of '{path}' must be numbers, got {item!r}") from None
    if not (math.isfinite(weight) and weight > 0) or (samples is not None and samples < 1):
        raise DataError(f"{key}: weight/samples of '{path}' must be > 0, got {item!r}")
    columns = item.get("columns")
    if columns is not None and not (
        isinstance(columns, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in columns.items())
    ):
        raise DataError(f"{key}: columns of '{path}' must map old column names to new ones, got {columns!r}")
    streaming = item.get("streaming", False)
    if not isinstance(streaming, bool):
        raise DataError(f"{key}: streaming of '{path}' must be true or false, got {streaming!r}")
    if streaming and samples is not None:
        raise DataError(f"{key}: '{path}' is streamed, so its size is not known to take {samples} samples from; "
                        "give it a weight (its share of the mixture) instead")  # fmt: skip
    file_format = item.get("format")
    if file_format is not None and file_format not in FORMATS:
        raise DataError(f"{key}: format of '{path}' must be one of {', '.join(FORMATS)}, got {file_format!r}")
    if file_format and streaming:
        raise DataError(f"{key}: '{path}' with format {file_format} is read whole; remove streaming")
    text = {k: None if item.get(k) is None else str(item[k]) for k in ("name", "split", "revision", "data_dir")}
    data_files = None if item.get("data_files") is None else json.dumps(item["data_files"], sort_keys=True)
    return DataSource(path, **text, data_files=data_files, columns=json.dumps(columns) if columns else None,
                      weight=weight, samples=samples, streaming=streaming, format=file_format, key=key)  # fmt: skip


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


# --------------------------------------------------------------------------------------------------------------
# What a source reads: its split's files (local) or its resolved revision (Hub)


@dataclass
class _Resolved:
    kind: str  # file | folder | saved | hub
    split: str | None  # the split to load (None for a save_to_disk Dataset, which has none)
    files: list[Path]  # local files whose contents the data depends on
    builder: Any = None  # datasets builder of a folder or Hub data set
    options: dict[str, Any] | None = None  # builder options (CSV as text, .txt sample_by)


def _resolve(source: DataSource, text_sample_by: str) -> _Resolved:
    path = Path(source.path).expanduser()
    if not source.is_local:
        return _resolve_hub(source)
    if not path.exists():
        raise DataError(f"data file or folder not found: {source.path}")
    if source.name or source.data_files or source.data_dir or source.revision:
        if path.is_file():
            raise DataError(f"{source.path}: name, revision, data_files and data_dir apply to folders and Hub data "
                            "sets, not to a single file")  # fmt: skip
    if path.is_file():
        ending = ".txt" if source.format == "label_text" else file_ending(source.path)  # read line by line
        if source.format == "label_text":
            text_sample_by = "line"
        if ending is None:
            endings = ", ".join(EXTENSIONS)
            raise DataError(f"{path}: unsupported data file type '{path.suffix}' (use {endings}, or a folder)")
        split = _choose_split(["train"], source, "a single file has one split")
        return _Resolved("file", split, [path], options=reader_options(ending, [path], text_sample_by))
    if any((path / f).is_file() for f in SAVED_DATASET_FILES):
        return _resolve_saved(source, path)
    files = sorted(p for p in path.rglob("*") if p.is_file() and file_ending(p.name) and not _hidden(p, path))
    if not files:
        raise DataError(f"data folder {path} has no data files ({', '.join(EXTENSIONS)})")
    kinds = {EXTENSIONS[file_ending(p.name)][0] for p in files}
    if len(kinds) > 1 and not source.data_files and not source.data_dir:
        raise DataError(f"data folder {path} mixes file types ({', '.join(sorted(kinds))}); use one type per "
                        "folder, or pick files with data_files")  # fmt: skip
    builder = _builder(source, str(path))
    available = [str(s) for s in builder.config.data_files or {}]
    split = _choose_split(available, source, "the folder's files name these splits")
    split_files = [Path(f) for f in builder.config.data_files[split]]
    ending = file_ending(split_files[0].name) or ".json"
    return _Resolved("folder", split, split_files, builder, reader_options(ending, split_files, text_sample_by))


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith((".", "_")) for part in path.relative_to(root).parts)


def _resolve_saved(source: DataSource, path: Path) -> _Resolved:
    if (path / "dataset_dict.json").is_file():
        available = json.loads((path / "dataset_dict.json").read_text())["splits"]
        split = _choose_split(available, source, "this save_to_disk folder holds these splits")
        files = sorted(p for p in (path / split).rglob("*") if p.is_file())
        return _Resolved("saved", split, files)
    if source.split:
        raise DataError(f"{source.path} is a save_to_disk folder of one data set, without splits; remove split")
    return _Resolved("saved", None, sorted(p for p in path.rglob("*") if p.is_file()))


def _resolve_hub(source: DataSource) -> _Resolved:
    try:
        builder = _builder(source, source.path)
    except DataError:
        raise
    except Exception as error:
        raise DataError(f"data set '{source.path}' is not a local file or folder and could not be loaded from the Hub"
                        f": {_hub_message(error, source)}") from None  # fmt: skip
    splits = builder.info.splits or builder.config.data_files or {}
    split = _choose_split([str(s) for s in splits], source, "the data set has these splits")
    return _Resolved("hub", split, [], builder)


def _hub_message(error: Exception, source: DataSource) -> str:
    text = str(error)
    if "Config name is missing" in text or "BuilderConfig" in text:
        try:
            names = datasets.get_dataset_config_names(source.path, revision=source.revision)
            return f"it has several configs, choose one with name: ({', '.join(names)})"
        except Exception:
            pass
    return first_line(error)


def _builder(source: DataSource, path: str):
    kwargs = {"name": source.name, "revision": source.revision, "data_dir": source.data_dir}
    if source.data_files:
        kwargs["data_files"] = json.loads(source.data_files)
    try:
        with _quiet_datasets():
            return datasets.load_dataset_builder(path, **{k: v for k, v in kwargs.items() if v is not None})
    except FileNotFoundError as error:
        raise DataError(f"{source.where}: {first_line(error)}") from None
    except ValueError as error:
        if "Config name is missing" in str(error) or "BuilderConfig" in str(error):
            raise DataError(f"{source.where}: {_hub_message(error, source)}") from None
        if Path(path).exists():
            raise DataError(f"{source.where}: {first_line(error)}") from None
        raise


def _choose_split(available: list[str], source: DataSource, what: str) -> str:
    if source.split is not None:
        base = source.split.split("[")[0]  # datasets' slicing syntax, e.g. train[:10%]
        if base not in available:
            raise DataError(f"{source.path}: no split '{base}'; {what}: {', '.join(available)}")
        return source.split
    if len(available) == 1:
        return available[0]
    if not available:
        raise DataError(f"{source.path}: found no data files or splits")
    raise DataError(f"{source.path} has several splits ({', '.join(available)}); choose one: "
                    f"{source.key}: {{path: {source.path}, split: {suggested_split(available, source.key)}}}")  # fmt: skip


# The splits a message suggests, most likely first: training data's, then evaluation data's.
_TRAIN_SPLITS = ("train",)
_EVAL_SPLITS = ("validation", "valid", "val", "dev", "eval", "test")


def suggested_split(available: list[str], key: str) -> str:
    """The split of `available` a message offers as its example for config key `key`: for train_data the training
    one (`train`, else a `train_*`/`train-*` one such as `train_sft`, else the first), for eval_data the evaluation one
    (validation, then test, eval..., or a split named after one, such as `test_sft`)."""
    names = _EVAL_SPLITS if key == "eval_data" else _TRAIN_SPLITS
    for name in names:
        if name in available:
            return name
    for name in names:
        for split in available:
            if re.match(rf"{name}[\W_]", split.lower()) or re.search(rf"[\W_]{name}$", split.lower()):
                return split
    return available[0]


def fingerprint_sources(sources: list[DataSource], text_sample_by: str = "paragraph") -> str:
    """Hash of what the sources read (local files' contents; a Hub data set's resolved revision and files) and of
    how (split, renames, weights): what tokenised caches depend on."""
    h = hashlib.sha256()
    for source in sources:
        h.update(repr(source).encode() + (f"|format {source.format}".encode() if source.format else b""))
        resolved = _resolve(source, text_sample_by)
        h.update(f"{resolved.kind}|{resolved.split}\n".encode())
        if resolved.kind == "hub":
            # data_files resolve to hf://datasets/<name>@<commit>/...: an updated data set hashes differently.
            h.update(f"{resolved.builder.hash}|{resolved.builder.config.data_files}".encode())
        for path in resolved.files:
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------------------
# Loading


def load_source(
    source: DataSource, cache_dir: str | Path, seed: int, text_sample_by: str = "paragraph"
) -> datasets.Dataset:
    """Load one source as a memory-mapped `datasets.Dataset`, rename its columns and apply its weight.

    A `.txt` file becomes a `text` column with one row per `text_sample_by`: document (the whole file), paragraph
    (text between blank lines) or line.
    """
    if source.streaming:
        raise DataError(f"{source.where}: streaming: true is read by the pretrain and sft recipes' training data only; "
                        "remove it here")  # fmt: skip
    resolved = _resolve(source, text_sample_by)
    raw_cache = str(Path(cache_dir) / "raw")
    for path in resolved.files:
        if builder_of(path) in ("json", "csv", "text"):
            # pyarrow's JSON reader lets bytes that are not UTF-8 through, to fail when a row is read, unnamed.
            raise_if_not_utf8(path)
        if builder_of(path) == "csv":
            # Before pandas: a row with one field too many would silently become the index, not an error.
            raise_if_malformed(path)
    json_files = resolved.kind in ("file", "folder") and all(builder_of(p) == "json" for p in resolved.files)
    try:
        with _quiet_datasets():
            dataset = _load(source, resolved, cache_dir=raw_cache)
    except DataError:
        raise
    except Exception as error:  # datasets wraps parser errors (or says StopIteration): find the file and line
        for path in resolved.files:
            raise_if_malformed(path)
        if resolved.kind == "hub":
            raise DataError(f"could not load '{source.where}' from the Hub: {first_line(error)}") from None
        if not json_files:
            raise DataError(f"could not read {source.where}: {first_line(error)}") from None
        dataset = None  # valid JSON that datasets could not give one type per column: read below
    if json_files and (dataset is None or holds_json(dataset.features)):
        dataset = json_as_written(resolved.files, raw_cache)
    if source.format == "label_text":
        dataset = _label_text(dataset, source)
    if len(dataset) == 0:
        raise DataError(f"{source.where}: no rows")
    dataset = _rename(dataset, source)
    if source.samples is not None:
        return _take_rows(dataset, source.samples, seed)
    return _take_rows(dataset, int(round(source.weight * len(dataset))), seed)


def raise_unless_text(dataset: datasets.Dataset, column: str, where: str) -> None:
    """Raise a DataError naming the first row of `column` that is not a string (a number among strings, which JSON
    files keep as written, or a null): before a tokenizer is trained on the column."""
    if dataset.features[column] in (datasets.Value("string"), datasets.Value("large_string")):
        if dataset.data.column(column).null_count == 0:
            return
    row = next((i for i, v in enumerate(dataset[column]) if not isinstance(v, str)), None)
    if row is not None:
        raise DataError(f"{where}, row {row + 1}: column {column!r} must hold text, got {dataset[row][column]!r:.100}")


def _load(source: DataSource, resolved: _Resolved, **options):
    """datasets' loading of a resolved source; `options` go to `load_dataset` (`cache_dir`, or `streaming=True`)."""
    if resolved.kind == "saved":
        dataset = datasets.load_from_disk(source.path)
        return dataset[resolved.split] if resolved.split else dataset
    if resolved.kind == "file":
        builder = "text" if source.format == "label_text" else EXTENSIONS[file_ending(source.path)][0]
        return datasets.load_dataset(builder, data_files=[str(resolved.files[0])], split=resolved.split, **options,
                                     **resolved.options)  # fmt: skip
    kwargs = {"name": source.name, "revision": source.revision, "data_dir": source.data_dir}
    kwargs = {k: v for k, v in kwargs.items() if v is not None} | (resolved.options or {})
    if source.data_files:
        kwargs["data_files"] = json.loads(source.data_files)
    return datasets.load_dataset(source.path, split=resolved.split, **options, **kwargs)


def _label_text(dataset: datasets.Dataset, source: DataSource) -> datasets.Dataset:
    """`<label> <text>` lines (read as the `text` column, one row a line) as `label` and `text`; blank lines dropped.
    Labels of digits become numbers (class ids), others stay names."""
    rows = [line.strip() for line in dataset["text"] if line.strip()]
    pairs = [row.split(None, 1) for row in rows]
    bad = next((i for i, p in enumerate(pairs) if len(p) < 2), None)
    if bad is not None:
        raise DataError(f"{source.where}: line '{rows[bad]:.80}' is not '<label> <text>' (format: label_text)")
    labels = [label for label, _ in pairs]
    numeric = all(label.isdigit() for label in labels)
    return datasets.Dataset.from_dict(
        {"text": [text for _, text in pairs], "label": [int(x) for x in labels] if numeric else labels}
    )


@contextmanager
def _quiet_datasets():
    """datasets logs a file's parser error before raising it (pandas' message, printed again by ours otherwise)."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _rename(dataset: datasets.Dataset, source: DataSource) -> datasets.Dataset:
    renames = source.renames
    missing = [c for c in renames if c not in dataset.column_names]
    if missing:
        raise DataError(f"{source.where}: columns {missing} (to rename) not found; columns: {dataset.column_names}")
    clashes = [new for old, new in renames.items() if new in dataset.column_names and new not in renames]
    if clashes:
        raise DataError(f"{source.where}: renaming would overwrite existing columns {clashes}")
    return dataset.rename_columns(renames) if renames else dataset


def _take_rows(dataset: datasets.Dataset, count: int, seed: int) -> datasets.Dataset:
    """`count` rows: whole copies of the data set, then a seeded subset of it for the remainder."""
    if count == len(dataset) or len(dataset) == 0:
        return dataset
    whole, rest = divmod(count, len(dataset))
    parts = [dataset] * whole
    if rest:
        parts.append(dataset.shuffle(seed=seed).select(range(rest)))
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
