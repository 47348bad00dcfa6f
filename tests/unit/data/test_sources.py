from __future__ import annotations

import json
import shutil

import pytest
from support import ASSETS

from tunebook.data.sft import load_conversations
from tunebook.data.sources import load_source, parse_sources, suggested_split
from tunebook.errors import DataError


def _load(spec, tmp_path):
    return load_conversations(parse_sources(spec, "train_data"), "auto", tmp_path, seed=0)


def test_loads_each_format(tmp_path):
    assert len(_load(str(ASSETS / "alpaca.json"), tmp_path)) == 3
    chat = _load(str(ASSETS / "chat.jsonl"), tmp_path)
    assert json.loads(chat[0]["conversation"])["messages"][0] == {"role": "system", "content": "You are terse."}
    pc = _load(str(ASSETS / "prompt_completion.csv"), tmp_path)
    assert json.loads(pc[1]["conversation"])["messages"][1]["content"] == "Paris"


def test_weighted_mixture(tmp_path):
    spec = [{"path": str(ASSETS / "alpaca.json"), "weight": 2.0}, {"path": str(ASSETS / "chat.jsonl"), "weight": 0.5}]
    assert len(_load(spec, tmp_path)) == 3 * 2 + 1


def test_folder_source(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(2):
        shutil.copy(ASSETS / "chat.jsonl", folder / f"part{i}.jsonl")
    assert len(_load(str(folder), tmp_path / "cache")) == 4


@pytest.mark.parametrize(
    "name, message",
    [
        ("malformed.jsonl", r"malformed.jsonl, line 2: malformed JSON"),
        ("malformed.json", r"malformed.json, line 3: malformed JSON"),
        ("bad_fields.csv", r"bad_fields.csv, line 3: 3 fields where the header has 2"),
    ],
)
def test_malformed_files_name_file_and_line(name, message, tmp_path):
    with pytest.raises(DataError, match=message):
        load_source(parse_sources(str(ASSETS / name), "train_data")[0], tmp_path, seed=0)


def test_missing_columns_lists_found_and_expected(tmp_path):
    with pytest.raises(
        DataError, match=r"missing_columns.jsonl: cannot tell the data format from columns \['question', 'answer'\]"
    ):
        _load(str(ASSETS / "missing_columns.jsonl"), tmp_path)


def test_missing_file_and_bad_spec(tmp_path):
    with pytest.raises(DataError, match="data file or folder not found: nope/train.jsonl"):
        _load("nope/train.jsonl", tmp_path)
    with pytest.raises(DataError, match="weight/samples of .* must be > 0"):
        parse_sources([{"path": "a.jsonl", "weight": 0}], "train_data")
    with pytest.raises(
        DataError, match=r"train_data: each entry must be a path or a mapping with a .path.*unknown keys \[.file.\]"
    ):
        parse_sources([{"file": "a.jsonl"}], "train_data")


def test_label_text_files_are_read_as_written(tmp_path):
    # SST-2's stsa.binary.* files (../shared/data/sst2): '<label> <sentence>' per line, a name that ends in no type
    path = tmp_path / "stsa.binary.dev"
    path.write_text('1 a stirring , funny and " moving " film .\n\n0 one long string of cliches .\n')
    dataset = load_source(parse_sources({"path": str(path), "format": "label_text"}, "eval_data")[0], tmp_path, 0)
    assert dataset.to_list() == [
        {"text": 'a stirring , funny and " moving " film .', "label": 1},
        {"text": "one long string of cliches .", "label": 0},
    ]
    path.write_text("positive great\nnegative dull\n")  # names stay names
    dataset = load_source(parse_sources({"path": str(path), "format": "label_text"}, "x")[0], tmp_path / "c2", 0)
    assert dataset["label"] == ["positive", "negative"]
    path.write_text("1 fine\nno-text-here\n")
    with pytest.raises(DataError, match=r"stsa.binary.dev: line 'no-text-here' is not '<label> <text>'"):
        load_source(parse_sources({"path": str(path), "format": "label_text"}, "x")[0], tmp_path / "c3", 0)
    with pytest.raises(DataError, match=r"format of 'a.txt' must be one of label_text, got 'csv'"):
        parse_sources({"path": "a.txt", "format": "csv"}, "train_data")


def test_empty_file_is_a_clear_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(DataError, match="empty.jsonl"):
        _load(str(path), tmp_path / "cache")


def test_hub_name_offline_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="not a local file or folder and could not be loaded from the Hub"):
        _load("someone/some-dataset", tmp_path)


def test_jsonl_with_non_object_line(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n[1, 2]\n")
    with pytest.raises(DataError, match=r"list.jsonl, line 2"):
        _load(str(path), tmp_path / "cache")


def test_mixture_by_sample_counts_is_deterministic(tmp_path):
    spec = [{"path": str(ASSETS / "alpaca.json"), "samples": 7}, {"path": str(ASSETS / "chat.jsonl"), "samples": 1}]
    first = _load(spec, tmp_path)
    assert len(first) == 7 + 1
    assert _load(spec, tmp_path)["conversation"] == first["conversation"]
    with pytest.raises(DataError, match="weight or a samples count, not both"):
        parse_sources([{"path": "a.jsonl", "weight": 1, "samples": 3}], "train_data")
    with pytest.raises(DataError, match="must be > 0"):
        parse_sources([{"path": "a.jsonl", "samples": 0}], "train_data")


@pytest.mark.parametrize(
    ("available", "key", "suggested"),
    [
        (["test_sft", "train_sft"], "train_data", "train_sft"),  # UltraChat: not the first one listed
        (["test", "train", "validation"], "train_data", "train"),
        (["test_gen", "train_gen", "train"], "train_data", "train"),  # train itself before train_*
        (["sft_test", "sft_train"], "train_data", "sft_train"),
        (["a", "b"], "train_data", "a"),  # no name to go by: the first
        (["test_sft", "train_sft"], "eval_data", "test_sft"),
        (["train", "test", "validation"], "eval_data", "validation"),  # validation before test
        (["train", "dev"], "eval_data", "dev"),
        (["train", "b"], "eval_data", "train"),
    ],
)
def test_a_folder_with_several_splits_suggests_the_one_its_key_would_use(available, key, suggested):
    assert suggested_split(available, key) == suggested
