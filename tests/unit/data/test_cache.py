from __future__ import annotations

import copy
import shutil

import pytest
from support import ASSETS

from tunebook.data.sft import prepare_sft_dataset
from tunebook.data.sources import parse_sources
from tunebook.errors import DataError


def _prepare(path, tokenizer, cache, **overrides):
    kwargs = dict(
        data_format="auto", max_seq_length=256, overlong="truncate", assistant_only_loss=True, cache_dir=cache, seed=0
    )
    kwargs.update(overrides)
    return prepare_sft_dataset(parse_sources(str(path), "train_data"), tokenizer, **kwargs)


def test_second_run_reuses_the_cache_and_any_input_change_rebuilds(tiny_tokenizer, tmp_path):
    data = tmp_path / "train.jsonl"
    shutil.copy(ASSETS / "chat.jsonl", data)
    cache = tmp_path / "cache"
    first, stats, cached = _prepare(data, tiny_tokenizer, cache)
    assert not cached and stats["examples_kept"] == 2
    again, _, cached = _prepare(data, tiny_tokenizer, cache)
    assert cached and again["input_ids"] == first["input_ids"]
    # memory-mapped from the cache folder, not held in RAM
    assert all(str(cache) in f["filename"] for f in again.cache_files)

    assert not _prepare(data, tiny_tokenizer, cache, max_seq_length=128)[2]
    assert not _prepare(data, tiny_tokenizer, cache, assistant_only_loss=False)[2]
    other_template = copy.deepcopy(tiny_tokenizer)
    other_template.chat_template = tiny_tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> ")
    assert not _prepare(data, other_template, cache)[2]
    data.write_text(data.read_text().replace("four", "4"))  # same size and name, new contents
    rebuilt, _, cached = _prepare(data, tiny_tokenizer, cache)
    assert not cached and rebuilt["input_ids"] != first["input_ids"]


def test_interrupted_build_leaves_no_entry(tiny_tokenizer, tmp_path, monkeypatch):
    import tunebook.data.sft as pipeline

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "tokenize_conversations", boom)
    with pytest.raises(KeyboardInterrupt):
        _prepare(ASSETS / "chat.jsonl", tiny_tokenizer, tmp_path)
    monkeypatch.undo()
    assert not _prepare(ASSETS / "chat.jsonl", tiny_tokenizer, tmp_path)[2]


def test_everything_dropped_is_an_error_that_says_why(tiny_tokenizer, tmp_path):
    with pytest.raises(DataError, match=r"no examples left.*2 longer than max_seq_length=8 were dropped"):
        _prepare(ASSETS / "chat.jsonl", tiny_tokenizer, tmp_path, max_seq_length=8, overlong="drop")
    with pytest.raises(DataError, match=r"no examples left.*2 had no loss-bearing tokens left"):
        _prepare(ASSETS / "chat.jsonl", tiny_tokenizer, tmp_path, max_seq_length=8)


def test_tokenizer_fingerprint_ignores_truncation_state_left_by_tokenising(tiny_tokenizer):
    from tunebook.data.cache import tokenizer_fingerprint

    before = tokenizer_fingerprint(tiny_tokenizer)
    tiny_tokenizer(["hello world " * 20], truncation=True, max_length=8)  # sets the backend's truncation state
    assert tiny_tokenizer.backend_tokenizer.truncation is not None
    assert tokenizer_fingerprint(tiny_tokenizer) == before
    tiny_tokenizer.backend_tokenizer.no_truncation()
