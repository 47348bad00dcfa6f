"""Environments for multi-turn GRPO episodes: what opens an episode and what answers each of the model's turns.

    environment.reset(row) -> messages                        # the episode's opening, from a prompt data row
    environment.step(messages) -> (observation, reward, done)  # after each model turn (the last message)

`messages` hold the episode so far; the model's turn is an assistant message whose `tool_calls` were parsed from
its text with the chat template's own format (`tunebook.rl.tool_calls`), and whose `invalid_tool_calls` say why a
call could not be parsed. `observation` is a list of messages (tool results) the model reads before its next turn;
`reward` (or None) is added to the episode's reward; `done` ends the episode. `tools` (tool definitions) are
rendered into the prompt by the chat template.

Built in: `ToolEnvironment`, Python functions as tools (`tools: [my_tools.py:calculator]`): every call is run and
its result (or its error, an unknown tool's name, an unparsable call) goes back as a tool message; a turn without
a call ends the episode. A tool's definition comes from its signature and docstring (`transformers.utils.
get_json_schema`: type hints, and an `Args:` line per argument).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..data.formats import as_messages
from ..errors import ConfigError, first_line
from ..user_code import load_function

__all__ = ["Environment", "ToolEnvironment", "load_tools", "tool_definition", "tool_definitions"]


class Environment:
    """The interface (see the module docstring); `reset`'s default is the row's `prompt` as messages."""

    tools: list[dict[str, Any]] = []

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        return as_messages(row["prompt"], "user", "prompt data")

    def step(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], float | None, bool]:
        raise NotImplementedError


class ToolEnvironment(Environment):
    """Python functions as tools: each of the model's calls is run, its result returned as a tool message."""

    def __init__(self, functions: dict[str, Callable]):
        self.functions = functions
        self.tools = [tool_definition(fn, name) for name, fn in functions.items()]

    def step(self, messages):
        turn = messages[-1]
        calls, invalid = turn.get("tool_calls") or [], turn.get("invalid_tool_calls") or []
        if not calls and not invalid:
            return [], None, True  # an answer: the episode ends
        observation = [self.call(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        observation += [{"role": "tool", "name": "error", "content": f"error: {why}"} for why in invalid]
        return observation, None, False

    def call(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """A tool message with the call's result; a tool's error is the model's to read, not the run's end."""
        fn = self.functions.get(name)
        if fn is None:
            content = f"error: unknown tool {name!r}; the tools are {', '.join(self.functions)}"
        else:
            try:
                result = fn(**arguments)
                content = result if isinstance(result, str) else json.dumps(result, default=str)
            except (KeyboardInterrupt, GeneratorExit):
                raise
            except BaseException as error:  # SystemExit too: the tool's failure is an observation
                content = f"error: {type(error).__name__}: {first_line(error)}"
        return {"role": "tool", "name": name, "content": content}


def tool_definition(fn: Callable, name: str | None = None) -> dict[str, Any]:
    """The function's tool definition (JSON schema) from its signature and docstring; a ConfigError where they do
    not give one (no docstring, an argument without a type hint or an `Args:` line)."""
    from transformers.utils import get_json_schema

    try:
        definition = get_json_schema(fn)
    except Exception as error:  # transformers' TypeHintParsingException / DocstringParsingException
        raise ConfigError(f"tool {name or fn.__name__!r}: {first_line(error)} (a tool needs type hints and a "
                          "docstring with an Args: line per argument)") from None  # fmt: skip
    if name:
        definition["function"]["name"] = name
    return definition


def tool_definitions(specs: list[str]) -> list[dict[str, Any]]:
    """The definitions of the config's `tools`, as the chat template renders them into the prompt."""
    return [tool_definition(fn, name) for name, fn in load_tools(specs).items()]


def load_tools(specs: list[str]) -> dict[str, Callable]:
    """{name: function} of the config's `tools` (path/to/file.py:function each), checked to give definitions."""
    functions: dict[str, Callable] = {}
    for spec in specs:
        if ":" not in spec:
            raise ConfigError(f"tool {spec!r}: expected path/to/file.py:function_name")
        fn = load_function(spec, "tool")
        name = spec.rpartition(":")[2]
        if name in functions:
            raise ConfigError(f"tools: two tools are named {name!r}; the model calls them by name")
        tool_definition(fn, name)
        functions[name] = fn
    return functions
