from __future__ import annotations

import json

import pytest

from tunebook.data.formats import detect_format, to_conversations
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


def to_messages(batch, **kwargs) -> list[list[dict]]:
    return [json.loads(row)["messages"] for row in to_conversations(batch, **kwargs)["conversation"]]


def test_alpaca_and_sharegpt_become_messages():
    batch = {"instruction": ["Add.", "Hi."], "input": ["1 2", None], "output": ["3", "hello"]}
    out = to_messages(batch, data_format="alpaca", where="a")
    assert out[0] == [{"role": "user", "content": "Add.\n1 2"}, {"role": "assistant", "content": "3"}]
    assert out[1][0]["content"] == "Hi."
    share = {"conversations": [[{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]]}
    assert to_messages(share, data_format="sharegpt", where="s")[0][1] == {"role": "assistant", "content": "a"}


def test_bad_chat_rows_are_named():
    answer = {"role": "assistant", "content": "y"}
    with pytest.raises(DataError, match="message 1 has role 'bot'"):
        to_messages({"messages": [[{"role": "bot", "content": "x"}, answer]]}, data_format="chat", where="c.jsonl")
    with pytest.raises(DataError, match=r"message 1 \(user\) has no content"):
        to_messages({"messages": [[{"role": "user"}, answer]]}, data_format="chat", where="c.jsonl")
    good = [{"role": "user", "content": "x"}, answer]
    with pytest.raises(DataError, match=r"c.jsonl, row 5: message 1 has role 'bot'"):
        to_messages(
            {"messages": [good, [{"role": "bot", "content": "x"}]]},
            data_format="chat",
            where="c.jsonl",
            indices=[3, 4],
        )
    with pytest.raises(DataError, match=r"c.jsonl: no assistant turn"):
        to_messages({"messages": [[{"role": "user", "content": "x"}]]}, data_format="chat", where="c.jsonl")


def test_bad_row_in_a_file_is_named_by_its_row(tmp_path):
    from tunebook.data import load_conversations, parse_sources

    path = tmp_path / "chat.jsonl"
    path.write_text(
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
        '{"messages": [{"role": "robot", "content": "b"}]}\n'
    )
    with pytest.raises(DataError, match=r"chat.jsonl, row 2: message 1 has role 'robot'"):
        load_conversations(parse_sources(str(path), "train_data"), "auto", tmp_path / "cache", seed=0)


def test_a_prompt_completion_row_marks_where_its_completion_starts():
    """Its prompt is context, assistant turns included: the loss starts at the completion (TRL's
    completion_only_loss), so a completion without an assistant turn has nothing to learn from."""
    earlier = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    batch = {"prompt": [earlier, "q"], "completion": [[{"role": "assistant", "content": "a2"}], "a"]}
    rows = [json.loads(r) for r in to_conversations(batch, data_format="prompt_completion", where="p")["conversation"]]
    assert [r["completion_start"] for r in rows] == [3, 1] and len(rows[0]["messages"]) == 4
    with pytest.raises(DataError, match=r"pc.jsonl, row 2: the completion has no assistant turn to learn from"):
        to_conversations({"prompt": ["q", earlier], "completion": ["a", [{"role": "user", "content": "q3"}]]},
                         [0, 1], data_format="prompt_completion", where="pc.jsonl")  # fmt: skip
