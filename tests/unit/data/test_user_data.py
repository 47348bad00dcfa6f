"""Data in the shapes users bring: Hub layouts by split, the file types and message formats people have, read
exactly as written, with the loss on the responses only. Each case builds a small file in that shape."""

from __future__ import annotations

import gzip
import json

import datasets
import pandas as pd
import pytest

from tunebook.data import load_conversations, parse_sources
from tunebook.data.sft import prepare_sft_dataset
from tunebook.data.sources import fingerprint_sources, load_source
from tunebook.data.tokenize import IGNORE_INDEX
from tunebook.errors import DataError
from tunebook.preference.data import preference_pair, prompt_and_response_ids, tokenize_pairs


def _chat(i: int, answer: str = "") -> list[dict]:
    return [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": answer or f"answer {i}"}]


def _hub_layout(root, train_rows=30, test_rows=10):
    """A Hub dataset snapshot: data/<split>-00000-of-00001.parquet, as UltraChat's train_sft/test_sft."""
    (root / "data").mkdir(parents=True)
    pd.DataFrame({"messages": [_chat(i) for i in range(train_rows)]}).to_parquet(
        root / "data" / "train_sft-00000-of-00001.parquet"
    )
    pd.DataFrame({"messages": [_chat(i) for i in range(test_rows)]}).to_parquet(
        root / "data" / "test_sft-00000-of-00001.parquet"
    )
    (root / "README.md").write_text("# a data set card\n")
    return root


def _load(spec, tmp_path, **kwargs):
    return [load_source(s, tmp_path / "cache", seed=0, **kwargs) for s in parse_sources(spec, "train_data")]


def _messages(spec, tmp_path, **kwargs) -> list[dict]:
    rows = load_conversations(parse_sources(spec, "train_data"), "auto", tmp_path / "cache", 0, **kwargs)
    return [json.loads(r) for r in rows["conversation"]]


def _loss_text(tokenizer, ids, labels) -> str:
    return tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE_INDEX])


# --------------------------------------------------------------------------------------------------------------
# Sources: splits are never merged


def test_a_hub_snapshot_folder_needs_a_split_and_gives_exactly_that_split(tmp_path):
    folder = _hub_layout(tmp_path / "datasets--HuggingFaceH4--ultrachat_200k" / "snapshots" / "0a1b2c3d")
    with pytest.raises(DataError, match=r"has several splits \((test_sft, train_sft|train_sft, test_sft)\); choose one: "
                       r"train_data: \{path: .*, split: train_sft\}$"):  # fmt: skip
        _load(str(folder), tmp_path)  # the training split suggested, whichever the folder lists first
    with pytest.raises(DataError, match=r"choose one: eval_data: \{path: .*, split: test_sft\}$"):
        load_source(parse_sources(str(folder), "eval_data")[0], tmp_path / "cache", seed=0)
    assert len(_load({"path": str(folder), "split": "train_sft"}, tmp_path)[0]) == 30
    assert len(_load({"path": str(folder), "split": "test_sft"}, tmp_path)[0]) == 10
    with pytest.raises(DataError, match=r"no split 'train'; the folder's files name these splits: .*train_sft"):
        _load({"path": str(folder), "split": "train"}, tmp_path)


def test_a_folder_of_split_files_and_a_save_to_disk_folder(tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    for split, n in (("train", 3), ("test", 2)):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"messages": _chat(i)}) + "\n" for i in range(n)))
    with pytest.raises(DataError, match="several splits"):
        _load(str(folder), tmp_path)
    assert len(_load({"path": str(folder), "split": "test"}, tmp_path)[0]) == 2

    saved = tmp_path / "saved"
    rows = datasets.Dataset.from_dict({"prompt": ["a", "b", "c"], "completion": ["1", "2", "3"]})
    datasets.DatasetDict({"train": rows, "validation": rows.select([0])}).save_to_disk(str(saved))
    with pytest.raises(DataError, match="save_to_disk folder holds these splits"):
        _load({"path": str(saved), "split": "test"}, tmp_path)
    assert len(_load({"path": str(saved), "split": "validation"}, tmp_path)[0]) == 1
    rows.save_to_disk(str(tmp_path / "one"))
    assert len(_load(str(tmp_path / "one"), tmp_path)[0]) == 3


def test_a_hub_name_is_loaded_by_split_and_its_revision_is_in_the_cache_key(tmp_path, monkeypatch):
    """The Hub code path, with datasets' loaders pointed at local folders standing for two revisions."""
    revisions = {None: _hub_layout(tmp_path / "v1"), "v2": _hub_layout(tmp_path / "v2", train_rows=31)}
    real_builder, real_load = datasets.load_dataset_builder, datasets.load_dataset
    calls = []

    def builder(path, revision=None, **kwargs):
        assert path == "org/ultrachat"
        return real_builder(str(revisions[revision]), **kwargs)

    def load(path, revision=None, **kwargs):
        calls.append((path, revision, kwargs.get("split")))
        return real_load(str(revisions[revision]), **kwargs)

    monkeypatch.setattr(datasets, "load_dataset_builder", builder)
    monkeypatch.setattr(datasets, "load_dataset", load)
    with pytest.raises(DataError, match=r"org/ultrachat has several splits"):
        _load("org/ultrachat", tmp_path)
    train = {"path": "org/ultrachat", "split": "train_sft"}
    assert len(_load(train, tmp_path)[0]) == 30 and calls[-1] == ("org/ultrachat", None, "train_sft")
    assert len(_load({**train, "revision": "v2"}, tmp_path)[0]) == 31
    first = fingerprint_sources(parse_sources(train, "train_data"))
    assert first == fingerprint_sources(parse_sources(train, "train_data"))
    assert first != fingerprint_sources(parse_sources({**train, "revision": "v2"}, "train_data"))


def test_columns_are_renamed_and_a_bad_rename_names_the_column(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    rows = _messages({"path": str(path), "columns": {"question": "prompt", "answer": "completion"}}, tmp_path)
    assert rows[0]["messages"] == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    with pytest.raises(DataError, match=r"columns \['query'\] \(to rename\) not found"):
        _load({"path": str(path), "columns": {"query": "prompt"}}, tmp_path)


def test_a_source_mapping_from_the_command_line(tmp_path):
    from tunebook.config import SFTConfig, load_config

    config = load_config(SFTConfig, ["--train_data", "{path: org/ultrachat, split: train_sft, name: default}"])
    (source,) = parse_sources(config.train_data, "train_data")
    assert (source.path, source.split, source.name) == ("org/ultrachat", "train_sft", "default")


# --------------------------------------------------------------------------------------------------------------
# Files: read exactly as written


def test_csv_and_tsv_cells_are_text_exactly_as_written(tmp_path):
    (tmp_path / "a.csv").write_text("prompt,completion\nzip?,0043\nmissing?,NA\nnothing?,null\nblank?,\ncount?,21\n")
    rows = _messages(str(tmp_path / "a.csv"), tmp_path)
    answers = [r["messages"][1]["content"] for r in rows]
    assert answers == ["0043", "NA", "null", "", "21"]
    (tmp_path / "b.tsv").write_text("prompt\tcompletion\nzip?\t007\n")
    assert _messages(str(tmp_path / "b.tsv"), tmp_path)[0]["messages"][1]["content"] == "007"


def test_jsonl_gz_and_arrow_files(tmp_path):
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    assert _messages(str(tmp_path / "a.jsonl.gz"), tmp_path)[0]["messages"][1]["content"] == "c"
    parquet = tmp_path / "p.parquet"
    pd.DataFrame({"text": ["hello arrow"]}).to_parquet(parquet)
    arrow = load_source(parse_sources(str(parquet), "x")[0], tmp_path / "cache", 0).cache_files[0]["filename"]
    copy = tmp_path / "t.arrow"
    copy.write_bytes(open(arrow, "rb").read())
    assert _messages(str(copy), tmp_path)[0] == {"text": "hello arrow"}


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.jsonl", "", r"empty.jsonl: empty file"),
        ("header.csv", "prompt,completion\n", r"header.csv: no rows below the header"),
        ("empty.json", "[]", r"empty.json: no rows"),
        ("ragged.tsv", "prompt\tcompletion\na\tb\tc\n", r"ragged.tsv, line 2: 3 fields where the header has 2"),
    ],
)
def test_empty_and_malformed_files_are_one_line_naming_the_file(tmp_path, capfd, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=message) as error:
        _load(str(tmp_path / name), tmp_path)
    assert "StopIteration" not in str(error.value) and "Instruction" not in str(error.value)
    assert "Failed to read" not in capfd.readouterr().err  # datasets' own report of the parser error


# --------------------------------------------------------------------------------------------------------------
# Formats


def test_content_parts_are_joined_and_an_image_part_is_refused_by_row(tmp_path):
    parts = [{"type": "text", "text": "Describe"}, {"type": "text", "text": "briefly."}]
    rows = [{"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "ok"}]}]
    rows.append({"messages": [{"role": "user", "content": [{"type": "image", "url": "x.png"}]}, *_chat(0)[1:]]})
    path = tmp_path / "parts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:1]))
    assert _messages(str(path), tmp_path)[0]["messages"][0]["content"] == "Describe\nbriefly."
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"parts.jsonl, row 2, message 1: a 'image' part; only text parts"):
        _messages(str(path), tmp_path)


def test_trl_conversational_prompt_completion(tmp_path):
    row = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
        "completion": [{"role": "assistant", "content": "Paris."}],
    }
    (tmp_path / "pc.jsonl").write_text(json.dumps(row) + "\n")
    assert _messages(str(tmp_path / "pc.jsonl"), tmp_path)[0]["messages"] == row["prompt"] + row["completion"]


def test_plain_text_trains_on_every_token_and_ends_with_eos(tmp_path, tiny_tokenizer):
    (tmp_path / "t.jsonl").write_text(json.dumps({"body": "hello world", "id": 1}) + "\n")
    sources = parse_sources(str(tmp_path / "t.jsonl"), "train_data")
    with pytest.raises(DataError, match="dataset_text_field"):
        load_conversations(sources, "auto", tmp_path / "cache", 0)
    data, _, _ = prepare_sft_dataset(sources, tiny_tokenizer, data_format="auto", max_seq_length=64,
                                     overlong="truncate", assistant_only_loss=True, cache_dir=tmp_path / "cache",
                                     seed=0, text_field="body")  # fmt: skip
    ids, labels = data[0]["input_ids"], data[0]["labels"]
    assert labels == ids and ids[-1] == tiny_tokenizer.eos_token_id and data[0]["prompt_length"] == 0
    assert tiny_tokenizer.decode(ids) == "hello world" + tiny_tokenizer.eos_token


def _tool_rows():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "18 degrees"},
        {"role": "assistant", "content": "It is 18 degrees."},
    ]
    plain = [{"role": "user", "content": "Hi", "tool_calls": None}, {"role": "assistant", "content": "Hello"}]
    return [{"messages": messages, "tools": json.dumps(tools)}, {"messages": plain, "tools": None}]


def test_tool_calls_are_rendered_and_trained_on_but_not_tool_results(tmp_path, tiny_tokenizer):
    # Parquet gives every message every key (None where absent): those must not read as tool calls.
    pd.DataFrame(_tool_rows()).to_parquet(tmp_path / "tools.parquet")
    sources = parse_sources(str(tmp_path / "tools.parquet"), "train_data")
    data, _, _ = prepare_sft_dataset(sources, tiny_tokenizer, data_format="auto", max_seq_length=1024,
                                     overlong="truncate", assistant_only_loss=True, cache_dir=tmp_path / "cache",
                                     seed=0)  # fmt: skip
    text = tiny_tokenizer.decode(data[0]["input_ids"])
    assert "get_weather" in text.split("<|im_start|>user")[0]  # the tool definition, in the system turn
    loss = _loss_text(tiny_tokenizer, data[0]["input_ids"], data[0]["labels"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in loss
    assert "It is 18 degrees." in loss and "18 degrees<|im_end|>\n<|im_start|>assistant" not in loss
    assert _loss_text(tiny_tokenizer, data[1]["input_ids"], data[1]["labels"]) == "Hello<|im_end|>\n"


def test_a_template_without_tool_support_is_refused_by_row(tmp_path, tiny_tokenizer):
    import copy

    plain = copy.deepcopy(tiny_tokenizer)
    plain.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    (tmp_path / "tools.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _tool_rows()))
    with pytest.raises(
        DataError, match=r"tools.jsonl, row 1: the chat template does not render the tool definition .get_weather."
    ):
        prepare_sft_dataset(parse_sources(str(tmp_path / "tools.jsonl"), "t"), plain, data_format="auto",
                            max_seq_length=1024, overlong="truncate", assistant_only_loss=True,
                            cache_dir=tmp_path / "cache", seed=0)  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Preference pairs: explicit and implicit prompts, loss on the responses only


def _pairs(tokenizer, rows):
    batch = {key: [r.get(key) for r in rows] for key in {k for r in rows for k in r}}
    return tokenize_pairs(batch, list(range(len(rows))), tokenizer=tokenizer, max_seq_length=256,
                          overlong="truncate", where="prefs.jsonl")  # fmt: skip


def test_implicit_prompts_are_the_shared_first_turns(tiny_tokenizer):
    """HH-RLHF / UltraFeedback-binarized shape: chosen and rejected are whole conversations."""
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ask = {"role": "user", "content": "2+2?"}
    row = {
        "chosen": [*history, ask, {"role": "assistant", "content": "4"}],
        "rejected": [*history, ask, {"role": "assistant", "content": "5"}],
    }
    out = _pairs(tiny_tokenizer, [row])
    for side, answer in (("chosen", "4"), ("rejected", "5")):
        ids, labels = out[f"{side}_input_ids"][0], out[f"{side}_labels"][0]
        assert _loss_text(tiny_tokenizer, ids, labels) == f"{answer}<|im_end|>\n"
        assert tiny_tokenizer.decode(ids).count("2+2?") == 1


def test_a_prompt_column_with_whole_conversations_renders_the_user_turn_once(tiny_tokenizer):
    """UltraFeedback-binarized: prompt is a string, chosen/rejected repeat it as their first turn."""
    row = {
        "prompt": "Name a colour.",
        "chosen": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Seven."}],
    }
    out = _pairs(tiny_tokenizer, [row])
    assert tiny_tokenizer.decode(out["chosen_input_ids"][0]).count("Name a colour.") == 1
    assert _loss_text(tiny_tokenizer, out["rejected_input_ids"][0], out["rejected_labels"][0]) == "Seven.<|im_end|>\n"


@pytest.mark.parametrize(
    "row, message",
    [
        ({"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: go"},
         "prompt is not guessed from a transcript"),
        ({"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
         "share no first turn"),
        ({"prompt": "q", "chosen": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "x"}],
          "rejected": "y"}, "first turns differ from the prompt"),
    ],
)  # fmt: skip
def test_ambiguous_pairs_are_one_line_naming_the_row(tiny_tokenizer, row, message):
    with pytest.raises(DataError, match=rf"prefs.jsonl, row 1: .*{message}"):
        _pairs(tiny_tokenizer, [row])


def test_a_batch_of_pairs_is_tokenised_as_each_pair_alone(tiny_tokenizer):
    """`tokenize_pairs` tokenises a whole `map` batch in one call: every row of a batch mixing the shapes (explicit
    prompt text, implicit prompt, prompt repeated in the responses, margins, a pair cut at max_seq_length) comes out
    as that row does alone, and as `prompt_and_response_ids` (one call per text) gives its ids."""
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ask = {"role": "user", "content": "Name a colour."}
    rows = [
        {"prompt": "2+2?", "chosen": "4", "rejected": "5, or so I think", "margin": 1.5},
        {"chosen": [*history, ask, {"role": "assistant", "content": "Blue."}],
         "rejected": [*history, ask, {"role": "assistant", "content": "Seven."}], "margin": 0.0},
        {"prompt": "Name a colour.", "chosen": [ask, {"role": "assistant", "content": "Red."}],
         "rejected": [ask, {"role": "assistant", "content": "A long answer " * 40}], "margin": -2},
    ]  # fmt: skip
    batch = _pairs(tiny_tokenizer, rows)
    for i, row in enumerate(rows):
        alone = _pairs(tiny_tokenizer, [row])
        assert {k: v[i] for k, v in batch.items()} == {k: v[0] for k, v in alone.items()}, f"row {i + 1}"
        prompt, chosen, rejected, tools = preference_pair(row, "t")
        prompt_ids, (chosen_ids, _) = prompt_and_response_ids(tiny_tokenizer, prompt, (chosen, rejected), tools, "t")
        assert batch["chosen_input_ids"][i] == prompt_ids + chosen_ids
        assert batch["chosen_labels"][i] == [IGNORE_INDEX] * len(prompt_ids) + chosen_ids
    assert batch["truncated"] == [False, False, True] and batch["margin"] == [1.5, 0.0, -2.0]
