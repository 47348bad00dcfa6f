"""Images in a vision-language model's data: rows in the shapes users bring, read into one form with their images as
references (`tunebook.data.image_files`: what a reference is, its size from the header, opening it in the
DataLoader's workers), and every image checked at preparation. No model or processor is needed here.

Row shapes, detected from the columns as `tunebook.data.formats` detects text formats:
- TRL's: `messages` whose content parts include `{"type": "image"}` placeholders, and an `images` column (a list;
  `image` for one) that fills them in order. Where no message has an image part, the images go before the text of
  the first user message whose content is a string, as TRL does.
- inline: `{"type": "image", "image"|"url"|"path"|"base64": ...}` parts that hold their image themselves (the keys
  transformers' chat templates read).
- LLaVA / ShareGPT: `conversations` of `{from, value}` with `<image>` in the text, and `image` (one) or `images`.
- prompt/completion (text or messages) with `images`, as TRL takes them.

An image is a path (relative to the data file's folder, or absolute), an http(s) URL, a `datasets.Image` value
(`{"bytes", "path"}`, either `None`), raw bytes, or a PIL image (a Hub data set decoded in memory; stored as PNG
bytes, since a decoded image cannot go into the Arrow cache).

The normal form of a row (`parse_image_row`), the images' positions among the text kept:

    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
     "images": [{"path": "/data/shapes/images/3f2a.png", "bytes": None}]}

As a data set (`read_image_source`): a `conversation` column, that JSON without `images` and with `where` (the
row's file and row, for errors met in workers), and an `images` column of `datasets.Image(decode=False)`:
datasets' own storage of an image, a path or its bytes, so the cache holds references and never decoded pixels.

A bad image (missing, unreadable, larger than `max_pixels`) is met in two places:
- `check_images`, at preparation: every image's header is read for its size (what the tokeniser needs to count a
  Qwen-style processor's image tokens). `on_bad_image: error` stops on the first with one line naming the data
  file, row and image; `skip` drops the row and counts it. Skipping happens here and only here, so a row never
  reaches a batch with an image known to be broken, and the counts are known before training.
- `open_image`, in a DataLoader worker: the image is decoded. A failure there is always an error, with the same
  line: the image passed the header check, so it changed since or is damaged past its header (a truncated file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import datasets
import numpy as np
import pyarrow.compute as pc

from ..errors import DataError
from .formats import (
    IMAGE_PART_KEYS,
    SHAREGPT_ROLES,
    as_messages,
    detect_format,
    normalise_messages,
    tool_definitions,
)
from .image_files import DEFAULT_MAX_IMAGE_PIXELS, base64_image, image_reference, image_size
from .sources import DataSource, load_source

__all__ = [
    "IMAGE_FEATURES",
    "CheckedImages",
    "check_images",
    "detect_image_format",
    "image_base_dir",
    "parse_image_prompt",
    "parse_image_row",
    "read_image_source",
    "to_image_conversations",
]

IMAGE_FORMATS = ("chat", "sharegpt", "prompt_completion")  # the formats of formats.py that can hold images
IMAGE_COLUMNS = ("images", "image")
IMAGE_TOKEN = "<image>"  # LLaVA's placeholder in the text
IMAGE_FEATURES = datasets.Features(
    {"conversation": datasets.Value("string"), "images": datasets.List(datasets.Image(decode=False))}
)
_SIZES_FEATURE = datasets.List(datasets.List(datasets.Value("int32")))


def detect_image_format(columns: list[str], data_format: str, where: str) -> tuple[str, str | None]:
    """(format, image column or None) of a data set with images; `data_format` as in `formats.detect_format`."""
    fmt = detect_format(columns, data_format, where)
    if fmt not in IMAGE_FORMATS:
        raise DataError(f"{where}: data format '{fmt}' has no place for images; a vision-language model reads "
                        "messages (with images), conversations (LLaVA's, <image>) or prompt/completion")  # fmt: skip
    present = [c for c in IMAGE_COLUMNS if c in columns]
    if len(present) > 1:
        raise DataError(f"{where}: both an 'images' and an 'image' column; keep one, or rename the other "
                        "({path: ..., columns: {image: image_path}})")  # fmt: skip
    return fmt, (present[0] if present else None)


# --------------------------------------------------------------------------------------------------------------
# Rows -> the normal form


def parse_image_row(
    row: dict[str, Any], *, where: str, data_format: str = "auto", base_dir: str | Path | None = None
) -> dict[str, Any]:
    """One row in any supported shape -> `{"messages": [...], "images": [reference, ...]}` (the module docstring's
    normal form; prompt/completion adds `completion_start`, a `tools` column `tools`, as `formats` does). Relative
    image paths resolve against `base_dir` (the data file's folder; the working directory when None). `where` names
    the file and row in errors."""
    fmt, column = detect_image_format(list(row), data_format, where)
    listed = _listed(row.get(column) if column else None)
    completion_start = None
    if fmt == "sharegpt":
        messages = _from_llava(row["conversations"], where)
    elif fmt == "chat":
        messages = normalise_messages(_images_first(row["messages"], len(listed)), where, image_parts=True)
    else:
        prompt = [{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str) else row["prompt"]
        completion = row["completion"]
        if not _has_image_part(completion):
            prompt = _images_first(prompt, len(listed))
        prompt = as_messages(prompt, "user", where, "prompt", image_parts=True)
        completion = as_messages(completion, "assistant", where, "completion", image_parts=True)
        if not any(m["role"] == "assistant" for m in completion):
            raise DataError(f"{where}: the completion has no assistant turn to learn from")
        messages, completion_start = prompt + completion, len(prompt)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant turn to learn from")
    values = _image_values(messages, listed, column, fmt, where)
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    images = [image_reference(v, base, f"{where}, image {k}") for k, v in enumerate(values, 1)]
    out: dict[str, Any] = {"messages": messages, "images": images}
    if completion_start is not None:
        out["completion_start"] = completion_start
    if row.get("tools") is not None:
        out["tools"] = tool_definitions(row["tools"], where)
    return out


def parse_image_prompt(
    prompt: Any, images: Any, *, where: str, column: str | None = "images", base_dir: str | Path | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A prompt-only row (GRPO's `prompt`: text or messages, and its `images` column's value, or None) -> (messages
    with bare image parts, image references in placeholder order), by the rules of `parse_image_row`: placeholders
    filled in order by the column's images, inline image parts, or TRL's images-first rule for text prompts."""
    listed = _listed(images)
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    messages = as_messages(_images_first(prompt, len(listed)), "user", where, "prompt", image_parts=True)
    values = _image_values(messages, listed, column if images is not None else None, "prompt_completion", where)
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    return messages, [image_reference(v, base, f"{where}, image {k}") for k, v in enumerate(values, 1)]


def _listed(value: Any) -> list[Any]:
    """An image column's value as a list: a list as is, one image as a list of one, nothing as []."""
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _has_image_part(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    return any(
        isinstance(p, dict) and p.get("type") == "image"
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for p in m["content"]
    )


def _images_first(messages: Any, count: int) -> Any:
    """TRL's rule for messages without image parts: `count` placeholders before the text of the first user message
    whose content is a string. Anything else is returned as it is (a count mismatch is reported later)."""
    if not count or not isinstance(messages, list) or _has_image_part(messages):
        return messages
    out = list(messages)
    for i, m in enumerate(out):
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
            out[i] = {**m, "content": [{"type": "image"}] * count + [{"type": "text", "text": m["content"]}]}
            break
    return out


def _from_llava(turns: Any, where: str) -> list[dict[str, Any]]:
    """LLaVA's `conversations`: each `<image>` becomes an image part where it stands, the whitespace beside it
    dropped ("<image>\\nWhat is this?" is an image, then "What is this?")."""
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: 'conversations' must be a non-empty list of {{from, value}}, got {turns!r:.200}")
    messages = []
    for number, t in enumerate(turns, 1):
        if not isinstance(t, dict) or t.get("from") not in SHAREGPT_ROLES or not isinstance(t.get("value"), str):
            raise DataError(f"{where}: turn {number} needs 'from' (one of {sorted(SHAREGPT_ROLES)}) and a text "
                            f"'value', got {t!r:.200}")  # fmt: skip
        pieces = t["value"].split(IMAGE_TOKEN)
        parts: list[dict[str, Any]] = []
        for i, piece in enumerate(pieces):
            if i:
                parts.append({"type": "image"})
            piece = piece.lstrip() if i else piece
            piece = piece.rstrip() if i < len(pieces) - 1 else piece
            if piece or len(pieces) == 1:
                parts.append({"type": "text", "text": piece})
        messages.append({"role": SHAREGPT_ROLES[t["from"]], "content": parts})
    return messages


def _image_values(messages: list[dict], listed: list, column: str | None, fmt: str, where: str) -> list[Any]:
    """The row's images in placeholder order; every image part becomes a bare `{"type": "image"}`."""
    inline, placeholders = [], 0
    for m in messages:
        if not isinstance(m.get("content"), list):  # a tool call's empty content
            continue
        for i, part in enumerate(m["content"]):
            if part["type"] != "image":
                continue
            key = next((k for k in IMAGE_PART_KEYS if k in part), None)
            if key is None:
                placeholders += 1
            else:
                inline.append({"bytes": base64_image(part[key], where)} if key == "base64" else part[key])
            m["content"][i] = {"type": "image"}
    what = f"'{IMAGE_TOKEN}' tokens" if fmt == "sharegpt" else "image placeholders"
    if inline and listed:
        raise DataError(f"{where}: {len(inline)} images inline in the messages and {len(listed)} in column "
                        f"{column!r}; give a row's images one way")  # fmt: skip
    if inline:
        if placeholders:
            raise DataError(f"{where}: {placeholders} image placeholders without an image beside {len(inline)} "
                            "inline images; give each image part its image, or use an 'images' column")  # fmt: skip
        return inline
    if placeholders != len(listed):
        source = f"in column {column!r}" if column else "(no 'images' column)"
        raise DataError(f"{where}: {placeholders} {what} but {len(listed)} images {source}; each image needs "
                        "one placeholder where it stands in the text")  # fmt: skip
    return listed


# --------------------------------------------------------------------------------------------------------------
# Data sets


def to_image_conversations(
    batch: dict[str, list[Any]], indices: list[int] | None = None, *, data_format: str, where: str,
    base_dir: str | Path | None = None, parse=parse_image_row,
) -> dict[str, list[Any]]:  # fmt: skip
    """Batched `datasets.map` function: rows of any supported shape -> {"conversation": [JSON], "images": [[ref]]}
    (`IMAGE_FEATURES`). With `with_indices=True` errors name the row, counted from 1 (a JSONL file's line).
    `parse` reads one row into its normal form (`parse_image_row`; preference pairs: `parse_image_pair`)."""
    n = len(next(iter(batch.values()))) if batch else 0
    conversations, images = [], []
    for i in range(n):
        where_row = where if indices is None else f"{where}, row {indices[i] + 1}"
        parsed = parse(
            {k: v[i] for k, v in batch.items()}, where=where_row, data_format=data_format, base_dir=base_dir
        )
        images.append(parsed.pop("images"))
        conversations.append(json.dumps({**parsed, "where": where_row}))
    return {"conversation": conversations, "images": images}


def read_image_source(
    source: DataSource, cache_dir: str | Path, seed: int, *, data_format: str = "auto",
    image_dir: str | Path | None = None, num_proc: int | None = None, parse=None,
) -> datasets.Dataset:  # fmt: skip
    """One source's rows in the normal form (`IMAGE_FEATURES`), read through `load_source` (weights, renames);
    `parse` reads a row of another task's shape (preference pairs), whose columns are its own to check.

    Relative image paths resolve against `image_dir`, else the data file's folder (a folder source: that folder).
    Images a data set holds as `datasets.Image` stay undecoded: their bytes are copied, never decoded here.
    """
    raw = load_source(source, cache_dir, seed)
    fmt = detect_image_format(raw.column_names, data_format, source.where)[0] if parse is None else data_format
    image_dir = image_base_dir(source, image_dir)
    return (
        raw.with_format("arrow")
        .map(
            _arrow_batch_to_image_conversations,
            batched=True,
            with_indices=True,
            fn_kwargs={
                "features": _undecoded(raw.features),
                "data_format": fmt,
                "where": source.where,
                "base_dir": image_dir,
                "parse": parse or parse_image_row,
            },
            remove_columns=raw.column_names,
            features=IMAGE_FEATURES,
            num_proc=num_proc,
            desc=f"Reading {Path(source.path).name} ({fmt}, with images)",
        )
        .with_format(None)
    )


def image_base_dir(source: DataSource, image_dir: str | Path | None) -> str | Path | None:
    """Where a source's relative image paths resolve: `image_dir`, else the data file's folder (a folder source:
    that folder); None (the working directory) for a Hub data set."""
    if image_dir is None and source.is_local:
        path = Path(source.path).expanduser().absolute()
        image_dir = path.parent if path.is_file() else path
    return image_dir


def _arrow_batch_to_image_conversations(table, indices, *, features, **kwargs) -> dict[str, list[Any]]:
    # Read as Arrow and decoded with `features`, whose images are not decoded: datasets would otherwise decode every
    # image of a `datasets.Image` column to pixels (and the map would have to encode them again).
    return to_image_conversations(features.decode_batch(table.to_pydict()), indices, **kwargs)


def _undecoded(feature: Any) -> Any:
    """`feature` with every `datasets.Image` in it set not to decode (JSON columns still decode)."""
    if isinstance(feature, datasets.Image):
        return datasets.Image(mode=feature.mode, decode=False)
    if isinstance(feature, datasets.Features):
        return datasets.Features({k: _undecoded(f) for k, f in feature.items()})
    if isinstance(feature, dict):
        return {k: _undecoded(f) for k, f in feature.items()}
    if isinstance(feature, list):
        return [_undecoded(f) for f in feature]
    if isinstance(feature, datasets.LargeList):
        return datasets.LargeList(_undecoded(feature.feature))
    if isinstance(feature, datasets.List):
        return datasets.List(_undecoded(feature.feature), length=feature.length)
    return feature


class CheckedImages(NamedTuple):
    dataset: datasets.Dataset  # the rows kept, with `image_sizes`: [[width, height], ...] in image order
    skipped: int  # rows dropped for a bad image (on_bad_image: skip)
    first_skipped: list[str]  # the first few of their lines, for the summary's warning


def check_images(
    dataset: datasets.Dataset, *, on_bad_image: str = "error", max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    num_proc: int | None = None,
) -> CheckedImages:  # fmt: skip
    """Read every image's size from its header (`image_size`) into an `image_sizes` column. A bad image stops
    with its line (`on_bad_image: error`) or drops its row (`skip`, counted): the one place rows are skipped.

    Never taken from a cache: the files may have changed or gone since the last run, so every preparation reads the
    headers again (a file open and a few kilobytes each). The sizes are held in memory beside the memory-mapped rows.
    """
    if on_bad_image not in ("error", "skip"):
        raise ValueError(f"on_bad_image must be 'error' or 'skip', got {on_bad_image!r}")
    read = [c for c in ("conversation", "images") if c in dataset.column_names]
    probes = dataset.select_columns(read).map(
        _probe_batch,
        batched=True,
        with_indices=True,
        fn_kwargs={"skip": on_bad_image == "skip", "max_pixels": max_pixels},
        remove_columns=read,
        features=datasets.Features({"image_sizes": _SIZES_FEATURE, "bad_image": datasets.Value("string")}),
        keep_in_memory=True,
        load_from_cache_file=False,
        num_proc=num_proc,
        desc="Checking images",
    )
    if "image_sizes" in dataset.column_names:  # checked before: sizes read again
        dataset = dataset.remove_columns("image_sizes")
    checked = dataset.add_column("image_sizes", probes.data.column("image_sizes"), feature=_SIZES_FEATURE)
    bad = probes.data.column("bad_image")
    skipped = len(bad) - bad.null_count
    if not skipped:
        return CheckedImages(checked, 0, [])
    first = pc.drop_null(bad).slice(0, 5).to_pylist()
    if skipped == len(dataset):
        raise DataError(f"every row has a bad image ({skipped} rows), the first: {first[0]}")
    kept = np.flatnonzero(pc.is_null(bad).to_numpy(zero_copy_only=False))
    return CheckedImages(checked.select(kept), skipped, first)


def _probe_batch(batch: dict[str, list], indices: list[int], *, skip: bool, max_pixels: int) -> dict[str, list]:
    sizes, bad = [], []
    for i, references in enumerate(batch["images"]):
        where = json.loads(batch["conversation"][i]).get("where") if "conversation" in batch else None
        where = where or f"row {indices[i] + 1}"
        try:
            sizes.append([list(image_size(r, f"{where}, image {k}", max_pixels)) for k, r in enumerate(references, 1)])
            bad.append(None)
        except DataError as error:
            if not skip:
                raise
            sizes.append([])
            bad.append(str(error))
    return {"image_sizes": sizes, "bad_image": bad}
