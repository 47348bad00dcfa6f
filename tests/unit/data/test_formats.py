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
    out = to_messages(batch, data_format="alpaca", where="a")["messages"]
    assert out[0] == [{"role": "user", "content": "Add.\n1 2"}, {"role": "assistant", "content": "3"}]
    assert out[1][0]["content"] == "Hi."
    share = {"conversations": [[{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]]}
    assert to_messages(share, data_format="sharegpt", where="s")["messages"][0][1] == {
        "role": "assistant",
        "content": "a",
    }


def test_bad_chat_rows_are_named():
    with pytest.raises(DataError, match="unknown message role 'bot'"):
        to_messages({"messages": [[{"role": "bot", "content": "x"}]]}, data_format="chat", where="c.jsonl")
    with pytest.raises(DataError, match="needs 'role' and 'content'"):
        to_messages({"messages": [[{"role": "user"}]]}, data_format="chat", where="c.jsonl")
    good = [{"role": "user", "content": "x"}]
    with pytest.raises(DataError, match=r"c.jsonl, row 5: unknown message role 'bot'"):
        to_messages(
            {"messages": [good, [{"role": "bot", "content": "x"}]]},
            data_format="chat",
            where="c.jsonl",
            indices=[3, 4],
        )


def test_bad_row_in_a_file_is_named_by_its_row(tmp_path):
    from tunebook.data import load_conversations, parse_sources

    path = tmp_path / "chat.jsonl"
    path.write_text(
        '{"messages": [{"role": "user", "content": "a"}]}\n{"messages": [{"role": "robot", "content": "b"}]}\n'
    )
    with pytest.raises(DataError, match=r"chat.jsonl, row 2: unknown message role 'robot'"):
        load_conversations(parse_sources(str(path), "train_data"), "auto", tmp_path / "cache", seed=0)
