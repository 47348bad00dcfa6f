"""Tool calls in a chat template's own format, learnt from the template: parse them out of a model's turn, and the
tokens that carry tool results back to it.

A template renders an assistant message's `tool_calls` its own way: the Hermes/Qwen convention of Tunebook's default
template wraps each call's JSON in `<tool_call>...</tool_call>`; Llama 3.1 writes the bare JSON as the whole turn,
with `parameters` for `arguments`. Rather than a parser per model family, `ToolCallFormat.from_template` renders a
probe assistant turn with one known call through the template and reads off what surrounds the JSON and which keys
hold the name and the arguments; a model trained on that template writes its calls the same way. A template that
drops the probe call cannot render tool calls at all: a ConfigError says so.

The environment's messages (tool results) reach the model as the text the template adds for them after an
assistant turn, through the next generation prompt (`observation_text`), as TRL does (`_get_tool_suffix_ids`):
rendered after a stand-in assistant turn, never re-rendering the model's own tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..data.tokenize import render_chat
from ..errors import ConfigError, DataError

__all__ = ["ToolCallFormat", "observation_text"]

PROBE_NAME = "tunebook_probe_tool"
PROBE_ARGUMENTS = {"probe_argument": "probe value 7"}
PROBE_TEXT = "probe answer 7"
PROBE_TOOLS = [{"type": "function", "function": {
    "name": PROBE_NAME, "description": "A probe.",
    "parameters": {"type": "object", "properties": {"probe_argument": {"type": "string", "description": "A probe."}},
                   "required": ["probe_argument"]}}}]  # fmt: skip
_USER = {"role": "user", "content": "probe question"}
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCallFormat:
    """How a chat template writes a tool call: `open` + JSON + `close` (`open` empty: the JSON is the whole turn), the
    JSON's keys for the name and the arguments, and `nested` where the JSON is `{"function": {...}}`."""

    open: str
    close: str
    name_key: str = "name"
    arguments_key: str = "arguments"
    nested: bool = False

    @classmethod
    def from_template(cls, tokenizer) -> ToolCallFormat:
        """The format of the tokenizer's chat template, from a probe turn rendered through it (see the module)."""
        call = {"type": "function", "function": {"name": PROBE_NAME, "arguments": PROBE_ARGUMENTS}}
        try:
            before = render_chat(tokenizer, [_USER], PROBE_TOOLS, generation_prompt=True)
            plain = render_chat(tokenizer, [_USER, {"role": "assistant", "content": PROBE_TEXT}], PROBE_TOOLS)
            called = render_chat(
                tokenizer, [_USER, {"role": "assistant", "content": "", "tool_calls": [call]}], PROBE_TOOLS
            )
        except DataError as error:
            raise ConfigError(f"tools: {error}; set chat_template to a template that renders tool calls") from None
        if not (plain.startswith(before) and called.startswith(before)) or PROBE_TEXT not in plain:
            raise ConfigError("tools: the chat template renders an assistant turn differently from the generation "
                              "prompt that asks for it, so tool calls cannot be read from generated turns; set "
                              "chat_template")  # fmt: skip
        plain, called = plain[len(before) :], called[len(before) :]
        end_of_turn = plain[plain.index(PROBE_TEXT) + len(PROBE_TEXT) :]
        found = _find_probe_call(called)
        if found is None:
            raise ConfigError(f"tools: the chat template does not render tool calls as JSON (a probe call to "
                              f"{PROBE_NAME!r} rendered as {called!r:.200}); set chat_template to a template that "
                              "renders tool calls, e.g. Tunebook's default (ChatML with <tool_call> JSON)")  # fmt: skip
        start, end, obj = found
        nested = isinstance(obj.get("function"), dict)
        inner = obj["function"] if nested else obj
        name_key = next(k for k, v in inner.items() if v == PROBE_NAME)
        arguments_key = next(k for k, v in inner.items() if _arguments(v) == PROBE_ARGUMENTS)
        close = called[end:]
        if end_of_turn.strip() and close.endswith(end_of_turn):
            close = close[: -len(end_of_turn)]
        return cls(called[:start], close, name_key, arguments_key, nested)

    def render(self, name: str, arguments: dict[str, Any]) -> str:
        """A call as the template writes it (for tests and warm-up data)."""
        inner = {self.name_key: name, self.arguments_key: arguments}
        return self.open + json.dumps({"function": inner} if self.nested else inner) + self.close

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]], list[str]]:
        """(the text outside tool calls, the calls as chat messages hold them, one error per call that does not
        parse) of a generated turn, decoded without its stop token."""
        opening = self.open.strip()
        if not opening:  # the call is the whole turn (Llama 3.1): the turn is JSON with a name, or it is text
            stripped = text.strip()
            if not stripped.startswith("{"):
                return text, [], []
            call, error = self._call(stripped)
            if call is None and not stripped.endswith("}"):
                return text, [], []
            return "", [call] if call else [], [error] if error else []
        closing = self.close.strip()
        pieces = text.split(opening)
        content, calls, errors = pieces[0], [], []
        for piece in pieces[1:]:
            body, found, after = piece.partition(closing) if closing else (piece, "", "")
            call, error = self._call(body.strip())
            calls += [call] if call else []
            errors += [error] if error else []
            content += after if found else ""
        return content.strip(), calls, errors

    def _call(self, body: str) -> tuple[dict | None, str | None]:
        try:
            obj, end = _DECODER.raw_decode(body)
        except json.JSONDecodeError as error:
            return None, f"the tool call is not valid JSON ({error.msg}): {body!r:.200}"
        inner = obj.get("function", obj) if isinstance(obj, dict) and self.nested else obj
        if not isinstance(inner, dict) or not isinstance(inner.get(self.name_key), str):
            return None, f"a tool call needs a {self.name_key!r}: {body!r:.200}"
        arguments = _arguments(inner.get(self.arguments_key, {}))
        if not isinstance(arguments, dict):
            return None, f"the arguments of tool call {inner[self.name_key]!r} are not a JSON object: {body!r:.200}"
        return {"type": "function", "function": {"name": inner[self.name_key], "arguments": arguments}}, None


def _arguments(value: Any) -> Any:
    """Arguments as an object: some templates write them as a JSON string."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _find_probe_call(text: str) -> tuple[int, int, dict] | None:
    """(start, end, object) of the first JSON object in `text` that holds the probe call's name."""
    for start in (i for i, c in enumerate(text) if c == "{"):
        try:
            obj, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        inner = obj.get("function", obj) if isinstance(obj, dict) else None
        if isinstance(inner, dict) and PROBE_NAME in inner.values():
            return start, end, obj
    return None


def observation_text(tokenizer, tools: list[dict], observation: list[dict[str, Any]], stop_text: str | None) -> str:
    """The text that follows a model's turn ending in its stop token (`stop_text`, decoded) when the environment
    answers with `observation` (tool messages): the rest of the assistant turn's ending, the messages, and the next
    generation prompt, as the template renders them after a stand-in assistant turn with a tool call."""
    name = next((m["name"] for m in observation if m.get("name")), PROBE_NAME)
    stand_in = {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}  # fmt: skip
    prefix = render_chat(tokenizer, [_USER, stand_in], tools)
    full = render_chat(tokenizer, [_USER, stand_in, *observation], tools, generation_prompt=True)
    if not full.startswith(prefix):
        raise DataError("the chat template renders an assistant turn differently once tool results follow it, so "
                        "the results cannot be appended to the model's own tokens; set chat_template")  # fmt: skip
    # The model's tokens end with its stop token: what the template writes after it (a newline) comes next.
    cut = prefix.rfind(stop_text) + len(stop_text) if stop_text and stop_text in prefix else len(prefix)
    return full[cut:]
