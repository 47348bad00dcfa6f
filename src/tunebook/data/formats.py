"""Detect a data set's format from its columns and turn every row into one conversation (or one plain text).

Supported, in the order auto-detection tries them:
- chat: `messages`, a list of `{role, content}` (system, user, assistant, tool); `content` a string or a list of
  parts (`{"type": "text", "text": ...}`, joined by newlines); assistant `tool_calls`; a `tools` column;
- sharegpt: `conversations`, a list of `{from, value}`;
- alpaca: `instruction` (+ `input`) and `output`;
- prompt_completion: `prompt` and `completion`, each a string or a list of messages (TRL's conversational form);
  only the completion carries loss, not an assistant turn of the prompt (TRL's `completion_only_loss`);
- text: a plain text column (`text`, or `dataset_text_field`): the whole text carries the loss.

A row becomes a JSON string, `{"messages": [...], "tools": [...]}` (prompt_completion adds `"completion_start"`, the
index of the completion's first message) or `{"text": ...}`: JSON because messages with tool
calls have a different shape in every row, which an Arrow column cannot hold without inventing `None` fields. Rows
read from Arrow/Parquet do carry such `None` fields (every struct gets every key), so they are dropped here: a chat
template that asks `'tool_calls' in message` would otherwise see a tool call in every turn.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import DataError

__all__ = [
    "FORMAT_COLUMNS",
    "as_messages",
    "detect_format",
    "message_parts",
    "message_text",
    "normalise_messages",
    "to_conversations",
    "tool_definitions",
]

# Required columns per format; detection tries them in this order. `text` stands for dataset_text_field.
FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def detect_format(columns: list[str], data_format: str, where: str, text_field: str = "text") -> str:
    """Return the format name; `data_format` is 'auto' or a key of FORMAT_COLUMNS. `where` names the source."""

    def required(name: str) -> tuple[str, ...]:
        return (text_field,) if name == "text" else FORMAT_COLUMNS[name]

    if data_format != "auto":
        missing = [c for c in required(data_format) if c not in columns]
        if missing:
            raise DataError(
                f"{where}: data_format '{data_format}' needs columns {list(required(data_format))}, "
                f"missing {missing}; columns found: {columns} (rename columns with {{path: ..., columns: {{old: new}}}})"
            )
        return data_format
    for name in FORMAT_COLUMNS:
        if all(c in columns for c in required(name)):
            return name
    expected = "; ".join(f"{name}: {list(required(name))}" for name in FORMAT_COLUMNS)
    raise DataError(
        f"{where}: cannot tell the data format from columns {columns}; expected one of {expected} "
        "(rename columns with {path: ..., columns: {old: new}}, or set dataset_text_field)"
    )


def to_conversations(
    batch: dict[str, list[Any]], indices: list[int] | None = None, *, data_format: str, where: str,
    text_field: str = "text",
) -> dict[str, list[str]]:  # fmt: skip
    """Batched `datasets.map` function: any supported format -> {"conversation": [JSON text, ...]}.

    With `with_indices=True` the 0-based row numbers arrive as `indices`, and errors name the row (counted from 1,
    which is the line of a JSONL file without blank lines).
    """
    n = len(next(iter(batch.values()))) if batch else 0
    out = []
    for i in range(n):
        where_row = where if indices is None else f"{where}, row {indices[i] + 1}"
        if data_format == "text":
            value = batch[text_field][i]
            if not isinstance(value, str):
                raise DataError(f"{where_row}: column {text_field!r} must hold text, got {value!r:.100}")
            out.append(json.dumps({"text": value}))
            continue
        if data_format == "chat":
            messages = normalise_messages(batch["messages"][i], where_row)
        elif data_format == "sharegpt":
            messages = _from_sharegpt(batch["conversations"][i], where_row)
        elif data_format == "alpaca":
            prompt = _text(batch["instruction"][i])
            extra = _text(batch["input"][i]) if "input" in batch else ""
            messages = [
                {"role": "user", "content": f"{prompt}\n{extra}" if extra else prompt},
                {"role": "assistant", "content": _required(batch["output"][i], "output", where_row)},
            ]
        elif data_format == "prompt_completion":
            prompt = as_messages(batch["prompt"][i], "user", where_row, "prompt")
            completion = as_messages(batch["completion"][i], "assistant", where_row, "completion")
            if not any(m["role"] == "assistant" for m in completion):
                raise DataError(f"{where_row}: the completion has no assistant turn to learn from")
            messages = prompt + completion
        else:
            raise ValueError(f"unknown data format {data_format!r}")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where_row}: no assistant turn to learn from")
        conversation = {"messages": messages}
        if data_format == "prompt_completion":  # the prompt is context, its assistant turns too (TRL's
            conversation["completion_start"] = len(prompt)  # completion_only_loss): the loss starts here
        if batch.get("tools") is not None and batch["tools"][i] is not None:
            conversation["tools"] = tool_definitions(batch["tools"][i], where_row)
        out.append(json.dumps(conversation))
    return {"conversation": out}


def as_messages(
    value: Any, role: str, where: str, column: str | None = None, *, image_parts: bool = False
) -> list[dict[str, Any]]:
    """A string as one message of `role`, or a list of messages checked and normalised; errors name `column`.
    `image_parts`: as in `normalise_messages`."""
    if isinstance(value, str):
        return [{"role": role, "content": [{"type": "text", "text": value}] if image_parts else value}]
    what = f"column {column!r}" if column else f"the {role} text"
    if value is None:
        raise DataError(f"{where}: {what} is missing (null)")
    if not isinstance(value, list):  # a number among strings, say: as written, and not text
        raise DataError(f"{where}: {what} must be text or a list of messages, got {value!r:.100}")
    return normalise_messages(value, where, image_parts=image_parts)


def normalise_messages(messages: Any, where: str, *, image_parts: bool = False) -> list[dict[str, Any]]:
    """Check a list of chat messages and bring it to the form chat templates expect: string content (text parts
    joined), tool-call arguments as objects, and no `None`-valued keys.

    With `image_parts` (a vision-language model's data, `tunebook.data.images`) content stays a list of parts in
    order, image parts among them (`message_parts`); without, an image part is refused (`message_text`).
    """
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}}, got {messages!r:.200}")
    out = []
    for number, m in enumerate(messages, 1):
        if not isinstance(m, dict) or "role" not in m:
            raise DataError(f"{where}: message {number} needs a 'role' and 'content', got {m!r:.200}")
        m = {k: v for k, v in m.items() if v is not None}
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {number} has role {m['role']!r}; expected one of {', '.join(ROLES)}")
        if "content" not in m and not m.get("tool_calls"):
            raise DataError(f"{where}: message {number} ({m['role']}) has no content")
        read = message_parts if image_parts else message_text
        m["content"] = read(m.get("content", ""), f"{where}, message {number}")
        if m.get("tool_calls"):
            if m["role"] != "assistant":
                raise DataError(f"{where}: message {number} ({m['role']}) has tool_calls; only assistant turns can")
            m["tool_calls"] = [_tool_call(call, f"{where}, message {number}") for call in m["tool_calls"]]
        else:
            m.pop("tool_calls", None)
        out.append(m)
    return out


def message_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of parts whose text parts are joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(part, str):
                texts.append(part)
            elif kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                what = f"a {kind!r} part" if kind else f"a part {part!r:.80}"
                raise DataError(f"{where}: {what}; only text parts can be trained on by a text model")
        return "\n".join(texts)
    raise DataError(f"{where}: content must be text or a list of parts, got {content!r:.100}")


IMAGE_PART_KEYS = ("image", "url", "path", "base64")  # where an image part holds its image (transformers reads these)


def message_parts(content: Any, where: str) -> list[dict[str, Any]]:
    """A message's content as a list of parts in order, for a vision-language model: text parts as
    `{"type": "text", "text": ...}` (a string, or a bare string part, becomes one) and image parts as given, without
    their `None` fields (Arrow gives every part every key), so an inline image (`IMAGE_PART_KEYS`) stays in place."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise DataError(f"{where}: content must be text or a list of parts, got {content!r:.100}")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            parts.append({k: v for k, v in part.items() if v is not None})
        else:
            what = f"a {kind!r} part" if kind else f"a part {part!r:.80}"
            raise DataError(f"{where}: {what}; a part is text ({{'type': 'text', 'text': ...}}) or an image "
                            "({'type': 'image'})")  # fmt: skip
    return parts


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise DataError(f"{where}: a tool call must be an object, got {call!r:.100}")
    call = _drop_none(call)
    function = call.get("function", call)
    if not isinstance(function, dict) or "name" not in function:
        raise DataError(f"{where}: a tool call needs a function name, got {call!r:.200}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI sends arguments as JSON text; chat templates expect an object
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise DataError(f"{where}: tool call {function['name']!r} has arguments that are not JSON") from None
    function = {**function, "arguments": arguments}
    return {**call, "function": function} if "function" in call else {"type": "function", "function": function}


def tool_definitions(value: Any, where: str) -> list[dict[str, Any]]:
    """A `tools` column's value as a list of tool (function) definitions without `None` fields."""
    if isinstance(value, str):  # often stored as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DataError(f"{where}: the tools column is text but not JSON") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"{where}: tools must be a list of tool (function) definitions, got {value!r:.200}")
    return [_drop_none(t) for t in value]


def _drop_none(value: Any) -> Any:
    """JSON without null members: Arrow gives every struct in a column every key, absent ones as None."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def _required(value: Any, column: str, where: str) -> str:
    if value is None:
        raise DataError(f"{where}: {column} is missing (null)")
    return str(value)


def _from_sharegpt(turns: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: 'conversations' must be a non-empty list of {{from, value}}, got {turns!r:.200}")
    out = []
    for number, t in enumerate(turns, 1):
        if not isinstance(t, dict) or t.get("from") not in SHAREGPT_ROLES or "value" not in t:
            raise DataError(f"{where}: turn {number} needs 'from' (one of {sorted(SHAREGPT_ROLES)}) and 'value', "
                            f"got {t!r:.200}")  # fmt: skip
        out.append({"role": SHAREGPT_ROLES[t["from"]], "content": message_text(_text(t["value"]), where)})
    return out
