"""Data files as users get them wrong (issue 42, point 5): each is one line naming the file, the row or line, the
column and the value; and values arrive as written, so an error names the row that holds the bad value."""

from __future__ import annotations

import csv
import gzip
import json
import logging

import pytest

from tunebook.config import ClassifyConfig, RewardConfig
from tunebook.data import load_conversations, parse_sources
from tunebook.data.files import EXTENSIONS
from tunebook.data.sources import load_source
from tunebook.errors import DataError
from tunebook.locations import DATA_FILE_ENDINGS
from tunebook.preference.data import prepare_preference_data


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _source(path, tmp_path):
    return load_source(parse_sources(str(path), "train_data")[0], tmp_path / "cache", seed=0)


def _messages(path, tmp_path) -> list[list[dict]]:
    rows = load_conversations(parse_sources(str(path), "train_data"), "auto", tmp_path / "cache", 0)
    return [json.loads(r)["messages"] for r in rows["conversation"]]


def test_the_data_file_endings_the_config_check_knows_are_the_ones_sources_read():
    assert set(DATA_FILE_ENDINGS) == set(EXTENSIONS)


# --------------------------------------------------------------------------------------------------------------
# Bytes that are not UTF-8


@pytest.mark.parametrize("name", ["bad.jsonl", "bad.json", "bad.csv", "bad.txt", "bad.jsonl.gz"])
def test_bytes_that_are_not_utf8_are_named_by_file_line_and_column(tmp_path, name):
    """Before: a UnicodeDecodeError naming neither file nor line, once a row was read (JSON), or pandas' (CSV)."""
    lines = {
        "bad.jsonl": [b'{"text": "fine"}', b'{"text": "also fine"}', b'{"text": "caf\xe9 \xff"}'],
        "bad.json": [b"[", b'{"text": "fine"},', b'{"text": "also fine"},', b'{"text": "caf\xe9 \xff"}', b"]"],
        "bad.csv": [b"prompt,completion", b"a,b", b"caf\xe9 \xff,c"],
        "bad.txt": [b"fine", b"", b"caf\xe9 \xff"],
    }
    content = b"\n".join(lines[name.replace(".gz", "")]) + b"\n"
    path = tmp_path / name
    path.write_bytes(gzip.compress(content) if name.endswith(".gz") else content)
    line = content.count(b"\n", 0, content.index(b"caf\xe9")) + 1
    column = len(content.splitlines()[line - 1].split(b"caf")[0]) + 4  # 1-based, in characters
    with pytest.raises(DataError) as error:
        _source(path, tmp_path)
    assert (
        str(error.value) == f"{path}, line {line}, column {column}: not UTF-8 text (byte 0xe9); save the file as UTF-8"
    )


def test_utf8_text_with_every_width_of_character_loads(tmp_path, monkeypatch):
    import tunebook.data.files as files

    monkeypatch.setattr(files, "UTF8_CHUNK", 7)  # characters of 2, 3 and 4 bytes cut by the chunks' ends
    text = "é ü ✓ 日本 🙂 " * 50
    path = _write_jsonl(tmp_path / "ok.jsonl", [{"prompt": text, "completion": text[::-1]}] * 5)
    assert max(open(path, "rb").read()) > 127  # the characters as UTF-8 bytes, not JSON escapes
    assert _messages(path, tmp_path)[0][0]["content"] == text


# --------------------------------------------------------------------------------------------------------------
# A column whose type varies from row to row: values as written


def test_a_number_among_strings_arrives_as_written_and_the_error_names_its_row(tmp_path):
    """Before: datasets stored the column as JSON text, so "0000" came back as 0, and the error blamed row 1."""
    rows = [{"prompt": f"code {i}?", "completion": "0000"} for i in range(3)]
    rows += [{"prompt": "code 3?", "completion": 7}, {"prompt": "code 4?", "completion": "0012"}]
    path = _write_jsonl(tmp_path / "codes.jsonl", rows)
    assert _source(path, tmp_path)["completion"] == ["0000", "0000", "0000", 7, "0012"]
    with pytest.raises(DataError) as error:
        _messages(path, tmp_path)
    assert str(error.value) == f"{path}, row 4: column 'completion' must be text or a list of messages, got 7"


@pytest.mark.parametrize("ending", [".jsonl", ".json"])
def test_a_column_of_text_and_message_lists_keeps_text_that_looks_like_json(tmp_path, ending):
    """A TRL-style column mixing strings and message lists (both supported) loses no string: "0000", "7", "true",
    "[1]" and "null" stay text."""
    answers = ["0000", "7", "true", "[1]", "null", '{"a": 1}']
    rows = [{"prompt": f"q{i}", "completion": a} for i, a in enumerate(answers)]
    rows.append({"prompt": "q", "completion": [{"role": "assistant", "content": "0043"}]})
    path = tmp_path / f"mixed{ending}"
    if ending == ".json":
        path.write_text(json.dumps(rows))
    else:
        _write_jsonl(path, rows)
    assert [m[-1]["content"] for m in _messages(path, tmp_path)] == [*answers, "0043"]
    again = _source(path, tmp_path)  # from the raw cache now: the same values
    assert again["completion"][:-1] == answers


def test_nested_fields_of_varying_type_keep_their_values(tmp_path):
    """Content as a string in one message and a list of parts in another: both forms of the chat format."""
    rows = [
        {"messages": [{"role": "user", "content": "zip?"}, {"role": "assistant", "content": "0043"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "n?"}]},
                      {"role": "assistant", "content": "12"}]},
    ]  # fmt: skip
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    assert [m[1]["content"] for m in _messages(path, tmp_path)] == ["0043", "12"]


def _classify(tmp_path, rows):
    path = _write_jsonl(tmp_path / "labels.jsonl", rows)
    config = ClassifyConfig(train_data=path, output_dir=str(tmp_path / "out"))
    from tunebook.data import prepare_classification_data

    return path, lambda: prepare_classification_data(config, tmp_path / "cache", logging.getLogger("test"))


def test_classification_labels_of_mixed_kinds_and_text_that_is_not_text_name_the_row(tmp_path):
    rows = [{"text": f"t{i}", "label": "pos" if i % 2 else "neg"} for i in range(6)]
    path, prepare = _classify(tmp_path, [*rows[:4], {"text": "t4", "label": 1}, rows[5]])
    with pytest.raises(DataError) as error:
        prepare()
    assert str(error.value) == (
        f"{path}, row 5: label 1 in column 'label' is a number where row 1 has a name ('neg'); labels must be all "
        "class names or all class ids"
    )
    path, prepare = _classify(tmp_path, [*rows[:2], {"text": 42, "label": "pos"}, *rows[3:]])
    with pytest.raises(DataError) as error:
        prepare()
    assert str(error.value) == f"{path}, row 3: column 'text' must hold text, got 42"


def test_pretraining_text_that_is_not_text_names_the_row(tmp_path):
    """Before: a TypeError from tokenizer training ('int' object is not iterable)."""
    from tunebook.config import PretrainConfig
    from tunebook.data import prepare_text_data

    rows = [{"text": f"document {i} " * 5} for i in range(8)]
    rows[4]["text"] = 7
    path = _write_jsonl(tmp_path / "docs.jsonl", rows)
    config = PretrainConfig(train_data=path, output_dir=str(tmp_path / "out"))
    with pytest.raises(DataError) as error:
        prepare_text_data(config, tmp_path / "cache", logging.getLogger("test"))
    assert str(error.value) == f"{path}, row 5: column 'text' must hold text, got 7"


def test_grpo_reference_answers_of_mixed_types_reach_the_rewards_as_written(tmp_path):
    from tunebook.config import GRPOConfig
    from tunebook.rl import prepare_prompt_data

    rows = [{"prompt": f"q{i}", "answer": "0000" if i % 2 else 42} for i in range(8)]
    path = _write_jsonl(tmp_path / "prompts.jsonl", rows)
    config = GRPOConfig(train_data=path, output_dir=str(tmp_path / "out"), sft_warmup_steps=0)
    data = prepare_prompt_data(config, tmp_path / "cache", logging.getLogger("test"))
    assert data.train["answer"] == [42, "0000"] * 4


# --------------------------------------------------------------------------------------------------------------
# Preference data: a missing response, a margin that is not a number


def _pairs(count: int = 8, **extra) -> list[dict]:
    return [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}", **extra} for i in range(count)]


def _prepare_reward(tmp_path, path):
    config = RewardConfig(train_data=str(path), output_dir=str(tmp_path / "out"), max_seq_length=64)
    return prepare_preference_data(config, tmp_path / "cache", logging.getLogger("test"))


def test_a_row_without_rejected_names_the_missing_column(tmp_path):
    """Before: "row 4: messages must be a non-empty list of {role, content}, got None"."""
    rows = _pairs()
    del rows[3]["rejected"]
    path = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(DataError) as error:
        _prepare_reward(tmp_path, path)
    assert (
        str(error.value) == f"{path}, row 4: no 'rejected' response (the row has no 'rejected' column, or it is null)"
    )


def test_a_margin_that_is_not_a_number_is_named_by_its_row_and_numbers_in_csv_are_margins(tmp_path):
    """Before: CSV cells are text, so row 1's "1.5" was refused, and the error blamed row 1 for row 6's 'big'."""
    rows = _pairs(margin=1.5)
    rows[5]["margin"] = "big"
    path = tmp_path / "pairs.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, ["prompt", "chosen", "rejected", "margin"])
        writer.writeheader()
        writer.writerows(rows)
    with pytest.raises(DataError) as error:
        _prepare_reward(tmp_path, path)
    assert str(error.value) == f"{path}, row 6: column 'margin' must hold a finite number, got 'big'"
    jsonl = _write_jsonl(tmp_path / "pairs.jsonl", [*rows[:5], {**rows[5], "margin": float("inf")}])
    with pytest.raises(DataError, match=r"pairs.jsonl, row 6: column 'margin' must hold a finite number, got inf"):
        _prepare_reward(tmp_path, jsonl)
    rows[5]["margin"] = "-0.25"
    path.unlink()
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, ["prompt", "chosen", "rejected", "margin"])
        writer.writeheader()
        writer.writerows(rows)
    assert _prepare_reward(tmp_path, path).train["margin"] == [1.5] * 5 + [-0.25] + [1.5] * 2


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), "nan"])
def test_a_source_weight_must_be_a_finite_positive_number(weight):
    """Before: NaN passed `weight <= 0` and failed later as a ValueError from int(round(nan * rows))."""
    with pytest.raises(DataError, match=r"train_data: weight/samples of 'a.jsonl' must be > 0"):
        parse_sources([{"path": "a.jsonl", "weight": weight}], "train_data")


def test_a_data_file_given_as_model_or_tokenizer_is_called_a_file_by_the_library_too(tmp_path, tiny_tokenizer):
    """The config check stops such a config first; code that calls the library directly gets the same line (before:
    "could not load a tokenizer from directory '...train.jsonl'")."""
    from tunebook.errors import ModelError
    from tunebook.models import build_causal_lm
    from tunebook.models.tokenizer import load_tokenizer

    path = _write_jsonl(tmp_path / "train.jsonl", [{"text": "x"}])
    with pytest.raises(ModelError, match=rf"^{path} is a file, not a tokenizer directory"):
        load_tokenizer(path)
    with pytest.raises(ModelError, match=rf"^model_name_or_path {path} is a file, not a model directory"):
        build_causal_lm(tiny_tokenizer, model_name_or_path=path)
