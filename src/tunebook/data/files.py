"""Reading data files as they were written: which `datasets` builder reads an ending and with what options, CSV
and JSON read as written (no guessed types), and the checks that name a malformed or non-UTF-8 file by line and column
before `datasets` would fail on it with a traceback."""

from __future__ import annotations

import codecs
import csv
import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from ..errors import DataError

__all__ = ["EXTENSIONS", "file_ending", "raise_if_malformed", "raise_if_not_utf8", "reader_options"]

# File name endings -> (datasets builder, its options).
EXTENSIONS: dict[str, tuple[str, dict[str, Any]]] = {
    ".jsonl.gz": ("json", {}),
    ".json.gz": ("json", {}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"sep": "\t"}),
    ".parquet": ("parquet", {}),
    ".arrow": ("arrow", {}),
    ".txt": ("text", {}),
}


def file_ending(path: str) -> str | None:
    name = Path(path).name.lower()
    return next((e for e in EXTENSIONS if name.endswith(e)), None)


def reader_options(ending: str, files: list[Path], text_sample_by: str) -> dict[str, Any]:
    builder, options = EXTENSIONS[ending]
    options = dict(options)
    if builder == "text":
        options["sample_by"] = text_sample_by
    elif builder == "csv":
        # Every column as text, exactly as written: no number guessing (0043 -> 43, a column with one empty cell
        # -> floats) and no missing-value guessing (NA, null, an empty cell -> None).
        header = csv_header(files[0], options.get("sep", ","))
        options.update(
            features=datasets.Features({c: datasets.Value("string") for c in header}),
            keep_default_na=False,
            na_filter=False,
        )
    return options


def csv_header(path: Path, sep: str) -> list[str]:
    try:
        with open_text(path) as f:
            header = next(csv.reader(f, delimiter=sep), None)
    except UnicodeDecodeError:  # in the header or in the first block read with it
        raise_if_not_utf8(path)
        raise
    if not header:
        raise DataError(f"{path}: empty file (no header row)")
    return header


def open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz") else open(path, encoding="utf-8")


def builder_of(path: Path) -> str | None:
    ending = file_ending(path.name)
    return EXTENSIONS[ending][0] if ending else None


def holds_json(feature) -> bool:
    """Whether a datasets feature (or any inside it) is `datasets.Json`: what datasets' JSON reader makes of a field
    whose type varies from row to row."""
    if isinstance(feature, datasets.Json):
        return True
    if isinstance(feature, dict):
        return any(holds_json(f) for f in feature.values())
    if isinstance(feature, list | tuple):
        return any(holds_json(f) for f in feature)
    inner = getattr(feature, "feature", None)  # List, LargeList, Sequence
    return inner is not None and holds_json(inner)


AS_WRITTEN_VERSION = "1"  # bump when `json_as_written` changes what it writes


def json_as_written(files: list[Path], raw_cache: str) -> datasets.Dataset:
    """The rows of JSON / JSON Lines `files` with every value as written, memory-mapped from the raw cache.

    datasets' JSON reader stores a field whose type varies from row to row (an int among strings) as JSON text, but
    leaves the strings that parse as JSON unquoted: "0000" came back as 0, "7" as 7, and an error blamed row 1. Here
    a column of one type is an ordinary Arrow column, and any other column holds the JSON text of each value
    (`datasets.Json`), which reads back exactly as written.
    """
    h = hashlib.sha256(f"as-written-{AS_WRITTEN_VERSION}".encode())
    for path in files:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    target = Path(raw_cache) / f"json-as-written-{h.hexdigest()[:40]}.arrow"
    if not target.is_file():
        rows = [row for path in files for row in _json_rows(path)]
        columns = list(dict.fromkeys(key for row in rows for key in row))
        table = pa.table({column: _as_written([row.get(column) for row in rows]) for column in columns})
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        partial.replace(target)  # whole or not at all, for a process that reads it meanwhile
    return datasets.Dataset.from_file(str(target))


def _as_written(values: list) -> pa.Array:
    """One column: Arrow's type when its values share one, else each value's JSON text."""
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return pa.array([None if v is None else json.dumps(v) for v in values], type=pa.json_())


def _json_rows(path: Path) -> list[dict]:
    """The rows of a JSON array (or object) or JSON Lines file, each a dict (an array of strings: a `text` column,
    as datasets reads it)."""
    with open_text(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
        rows = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:  # JSON Lines, under either name
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [row if isinstance(row, dict) else {"text": row} for row in rows]


UTF8_CHUNK = 1 << 24  # bytes decoded at a time to check that a file is UTF-8


def raise_if_not_utf8(path: Path) -> None:
    """Raise a DataError naming the line and column of the first bytes in a text file that are not UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")()  # a character cut by a chunk's end continues in the next
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:  # the common case: decoding 16 MB at a time in C
            for chunk in iter(lambda: f.read(UTF8_CHUNK), b""):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
        return
    except UnicodeDecodeError:
        pass
    with opener(path, "rb") as f:  # a bad byte: find its line
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                column = len(line[: e.start].decode("utf-8")) + 1
                raise DataError(f"{path}, line {number}, column {column}: not UTF-8 text (byte "
                                f"0x{line[e.start]:02x}); save the file as UTF-8") from None  # fmt: skip


def raise_if_malformed(path: Path) -> None:
    """Raise a DataError naming the file and line of the first syntax error, or saying it is empty."""
    ending = file_ending(path.name)
    if ending is None or EXTENSIONS[ending][0] in ("parquet", "arrow", "text"):
        return
    if EXTENSIONS[ending][0] == "csv":
        sep = EXTENSIONS[ending][1].get("sep", ",")
        with open_text(path) as f:
            reader = csv.reader(f, delimiter=sep)
            header = next(reader, None)
            if header is None:
                raise DataError(f"{path}: empty file (no header row)")
            rows = 0
            for row in reader:
                if row and len(row) != len(header):
                    raise DataError(
                        f"{path}, line {reader.line_num}: {len(row)} fields where the header has {len(header)}"
                    )
                rows += bool(row)
            if rows == 0:
                raise DataError(f"{path}: no rows below the header")
        return
    with open_text(path) as f:
        text = f.read() if ending in (".json", ".json.gz") else None
        if text is not None:
            if not text.strip():
                raise DataError(f"{path}: empty file")
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                if "\n{" not in text.strip():  # not JSON Lines under a .json name either
                    raise DataError(f"{path}, line {e.lineno}: malformed JSON: {e.msg}") from None
                f = iter(text.splitlines(keepends=True))
            else:
                if not isinstance(data, list | dict):
                    raise DataError(f"{path}: expected a JSON array of objects, got {type(data).__name__}")
                if not data:
                    raise DataError(f"{path}: no rows (an empty JSON array)")
                return
        rows = 0
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {lineno}: malformed JSON: {e.msg}") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}, line {lineno}: each line must be a JSON object, got {type(row).__name__}")
            rows += 1
        if rows == 0:
            raise DataError(f"{path}: empty file (no JSON lines)")
