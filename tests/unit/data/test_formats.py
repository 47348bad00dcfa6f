from __future__ import annotations

import pytest

from tunebook.data.formats import detect_format, to_messages
from tunebook.errors import DataError


@pytest.mark.parametrize(
    "columns, expected",
    [
        (["messages"], "chat"),
        (["conversations", "id"], "sharegpt"),
        (["instruction", "input", "output"], "alpaca"),
        (["instruction", "output"], "alpaca"),
        (["prompt", "completion"], "prompt_completion"),
    ],
)
def test_detects_format_from_columns(columns, expected):
    assert detect_format(columns, "auto", "data.jsonl") == expected


def test_unknown_columns_list_found_and_expected():
    with pytest.raises(DataError) as e:
        detect_format(["question", "answer"], "auto", "qa.jsonl")
    text = str(e.value)
    assert "qa.jsonl" in text and "['question', 'answer']" in text and "instruction" in text and "messages" in text


def test_explicit_format_with_missing_column():
    with pytest.raises(DataError, match=r"data_format 'alpaca' needs.*missing \['output'\].*columns found"):
        detect_format(["instruction", "input"], "alpaca", "a.json")


def test_alpaca_and_sharegpt_become_messages():
    batch = {"instruction": ["Add.", "Hi."], "input": ["1 2", None], "output": ["3", "hello"]}
    out = to_messages(batch, "alpaca", "a")["messages"]
    assert out[0] == [{"role": "user", "content": "Add.\n1 2"}, {"role": "assistant", "content": "3"}]
    assert out[1][0]["content"] == "Hi."
    share = {"conversations": [[{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]]}
    assert to_messages(share, "sharegpt", "s")["messages"][0][1] == {"role": "assistant", "content": "a"}


def test_bad_chat_rows_are_named():
    with pytest.raises(DataError, match="unknown message role 'bot'"):
        to_messages({"messages": [[{"role": "bot", "content": "x"}]]}, "chat", "c.jsonl")
    with pytest.raises(DataError, match="needs 'role' and 'content'"):
        to_messages({"messages": [[{"role": "user"}]]}, "chat", "c.jsonl")
