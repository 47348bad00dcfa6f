"""Detect a data set's format from its columns and turn every row into chat `messages`.

Supported: Alpaca (`instruction`/`input`/`output`), chat (`messages` of `role`/`content`), ShareGPT
(`conversations` of `from`/`value`), and `prompt`/`completion`. Everything downstream (templating, label
masking, generation eval) works on `messages` only, so a new format needs only a converter here.
"""

from __future__ import annotations

from typing import Any

from ..errors import DataError

__all__ = ["FORMAT_COLUMNS", "detect_format", "to_messages"]

# Required columns per format; detection tries them in this order.
FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
}
ROLES = {"system", "user", "assistant"}
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def detect_format(columns: list[str], data_format: str, where: str) -> str:
    """Return the format name; `data_format` is 'auto' or a key of FORMAT_COLUMNS. `where` names the source."""
    if data_format != "auto":
        missing = [c for c in FORMAT_COLUMNS[data_format] if c not in columns]
        if missing:
            raise DataError(
                f"{where}: data_format '{data_format}' needs columns {list(FORMAT_COLUMNS[data_format])}, "
                f"missing {missing}; columns found: {columns}"
            )
        return data_format
    for name, required in FORMAT_COLUMNS.items():
        if all(c in columns for c in required):
            return name
    expected = "; ".join(f"{name}: {list(cols)}" for name, cols in FORMAT_COLUMNS.items())
    raise DataError(f"{where}: cannot tell the data format from columns {columns}; expected one of {expected}")


def to_messages(
    batch: dict[str, list[Any]], indices: list[int] | None = None, *, data_format: str, where: str
) -> dict[str, list[Any]]:
    """Batched `datasets.map` function: any supported format -> {"messages": [...]}.

    With `with_indices=True` the 0-based row numbers arrive as `indices`, and errors name the row (1-based,
    which is the line of a JSONL file without blank lines).
    """
    n = len(next(iter(batch.values())))
    out = []
    for i in range(n):
        where_row = where if indices is None else f"{where}, row {indices[i] + 1}"
        if data_format == "chat":
            messages = _check_chat(batch["messages"][i], where_row)
        elif data_format == "sharegpt":
            messages = _from_sharegpt(batch["conversations"][i], where_row)
        elif data_format == "alpaca":
            prompt = _text(batch["instruction"][i])
            extra = _text(batch["input"][i]) if "input" in batch else ""
            if extra:
                prompt = f"{prompt}\n{extra}"
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": _text(batch["output"][i])},
            ]
        elif data_format == "prompt_completion":
            messages = [
                {"role": "user", "content": _text(batch["prompt"][i])},
                {"role": "assistant", "content": _text(batch["completion"][i])},
            ]
        else:
            raise ValueError(f"unknown data format {data_format!r}")
        out.append(messages)
    return {"messages": out}


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def _check_chat(messages: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}, got {messages!r:.200}")
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: each message needs 'role' and 'content', got {m!r:.200}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: unknown message role {m['role']!r} (expected one of {sorted(ROLES)})")
        out.append({"role": m["role"], "content": _text(m["content"])})
    return out


def _from_sharegpt(turns: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: 'conversations' must be a non-empty list of {{from, value}}, got {turns!r:.200}")
    out = []
    for t in turns:
        if not isinstance(t, dict) or t.get("from") not in SHAREGPT_ROLES or "value" not in t:
            raise DataError(
                f"{where}: each ShareGPT turn needs 'from' (one of {sorted(SHAREGPT_ROLES)}) and 'value', got {t!r:.200}"
            )
        out.append({"role": SHAREGPT_ROLES[t["from"]], "content": _text(t["value"])})
    return out
