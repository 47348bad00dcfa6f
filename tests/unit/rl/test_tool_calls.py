"""Tool calls in the chat template's own format (`tunebook.rl.tool_calls`): learnt from the template, parsed back
out of its own renderings, and the text that carries tool results to the model."""

from __future__ import annotations

import copy

import pytest

from tunebook.data.tokenize import render_chat
from tunebook.errors import ConfigError
from tunebook.rl.tool_calls import ToolCallFormat, observation_text

# A Llama-3.1-style template: a call is the whole assistant turn, bare JSON with `parameters`, and tool results are
# `ipython` turns. Written here so the test needs no Hub tokenizer.
LLAMA31_STYLE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}{%- set role = 'ipython' %}{%- else %}{%- set role = message['role'] %}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' }}"
    "{%- if message['tool_calls'] is defined %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '{\"name\": \"' + call['function']['name'] + '\", \"parameters\": ' + (call['function']['arguments'] | tojson)"
    " + '}' }}"
    "{%- endfor %}"
    "{%- else %}{{- message['content'] }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
# A template that drops tool calls without a word (as Granite 3's does).
NO_TOOLS = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
CALLS = [
    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "123*456"}}},
    {"type": "function", "function": {"name": "lookup", "arguments": {"key": 'a "quoted" {brace}', "n": 3}}},
]


def _with_template(tokenizer, template):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def _assistant_turn(tokenizer, message) -> str:
    """The assistant turn as the template renders it, without the end-of-turn text: what the model generates before
    its stop token."""
    user = [{"role": "user", "content": "Multiply 123 by 456"}]
    before = render_chat(tokenizer, user, generation_prompt=True)
    through = render_chat(tokenizer, [*user, message])
    assert through.startswith(before)
    return through[len(before) :].removesuffix("\n").removesuffix(tokenizer.eos_token)


def test_the_default_templates_calls_round_trip(tiny_tokenizer):
    """The default (Hermes/Qwen) template: <tool_call> JSON </tool_call>, text beside the calls kept."""
    fmt = ToolCallFormat.from_template(tiny_tokenizer)
    assert (fmt.open.strip(), fmt.close.strip(), fmt.name_key, fmt.arguments_key) == (
        "<tool_call>", "</tool_call>", "name", "arguments",
    )  # fmt: skip
    for content, calls in [("", CALLS[:1]), ("Let me compute.", CALLS), ("no call here", [])]:
        message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        assert fmt.parse(_assistant_turn(tiny_tokenizer, message)) == (content, calls, [])


def test_another_templates_format_is_learnt_from_the_template(tiny_tokenizer):
    """Llama 3.1's convention: no delimiters, the whole turn is the call, `parameters` for the arguments."""
    tokenizer = _with_template(tiny_tokenizer, LLAMA31_STYLE)
    tokenizer.eos_token = "<|eot_id|>"
    fmt = ToolCallFormat.from_template(tokenizer)
    assert (fmt.open, fmt.close, fmt.arguments_key) == ("", "", "parameters")
    for call in CALLS:
        turn = _assistant_turn(tokenizer, {"role": "assistant", "content": "", "tool_calls": [call]})
        assert turn.startswith('{"name"') and fmt.parse(turn) == ("", [call], [])
    assert fmt.parse("56088") == ("56088", [], [])
    assert fmt.parse("{not json") == ("{not json", [], [])  # text that merely starts with a brace stays text


def test_a_template_that_cannot_render_tool_calls_is_a_config_error(tiny_tokenizer):
    with pytest.raises(ConfigError, match="does not render tool calls as JSON.*set chat_template") as error:
        ToolCallFormat.from_template(_with_template(tiny_tokenizer, NO_TOOLS))
    assert "\n" not in str(error.value).strip()


def test_calls_that_do_not_parse_are_reported_not_dropped(tiny_tokenizer):
    fmt = ToolCallFormat.from_template(tiny_tokenizer)
    content, calls, errors = fmt.parse(
        'ok <tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
        '<tool_call>\n{bad json}\n</tool_call><tool_call>\n{"arguments": {}}\n</tool_call>'
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'
    )
    assert content == "ok" and [c["function"]["name"] for c in calls] == ["calculator"]
    assert len(errors) == 3
    assert "not valid JSON" in errors[0] and "needs a 'name'" in errors[1] and "not a JSON object" in errors[2]


def test_tool_results_are_the_templates_text_after_the_models_stop_token(tiny_tokenizer):
    """What follows a turn ending in <|im_end|>: the newline the template writes after it, the tool turn, and the
    next generation prompt; rendering the whole conversation gives the same text."""
    observation = [{"role": "tool", "name": "calculator", "content": "56088"}]
    text = observation_text(tiny_tokenizer, [], observation, "<|im_end|>")
    assert text == "\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n"
    user = [{"role": "user", "content": "Multiply"}]
    turn = {"role": "assistant", "content": "", "tool_calls": CALLS[:1]}
    whole = render_chat(tiny_tokenizer, [*user, turn, *observation], generation_prompt=True)
    model_turn = render_chat(tiny_tokenizer, [*user, turn]).removesuffix("\n")  # up to its stop token
    assert whole == model_turn + text


@pytest.mark.parametrize(
    "name, eos, markers, calls",
    [
        ("qwen2.5-instruct", "<|im_end|>", ("<|im_start|>", "<tool_call>", "</tool_call>"), [CALLS, CALLS[:1]]),
        # Llama 3.1's template takes one call per turn
        ("llama-3.1-instruct", "<|eot_id|>", ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                              "<|eom_id|>", "<|python_tag|>"), [CALLS[:1], CALLS[1:]]),
    ],
)  # fmt: skip
def test_real_templates_calls_and_results_round_trip(name, eos, markers, calls):
    """The real templates (tests/assets/chat_templates): the calls of an assistant turn as the template renders it
    parse back to the calls; the text after a turn that called a tool is what the whole conversation renders."""
    from support import ASSETS, base_tokenizer

    tokenizer = base_tokenizer(eos, markers)
    tokenizer.chat_template = (ASSETS / "chat_templates" / f"{name}.jinja").read_text()
    fmt = ToolCallFormat.from_template(tokenizer)
    for turn_calls in calls:
        message = {"role": "assistant", "content": "", "tool_calls": turn_calls}
        assert fmt.parse(_assistant_turn(tokenizer, message)) == ("", turn_calls, [])
    user = [{"role": "user", "content": "Multiply"}]
    turn = {"role": "assistant", "content": "", "tool_calls": CALLS[:1]}
    observation = [{"role": "tool", "name": "calculator", "content": "56088"}]
    whole = render_chat(tokenizer, [*user, turn, *observation], generation_prompt=True)
    model_turn = render_chat(tokenizer, [*user, turn])
    model_turn = model_turn[: model_turn.rindex(eos) + len(eos)]  # the model's tokens end with its stop token
    assert whole == model_turn + observation_text(tokenizer, [], observation, eos)
