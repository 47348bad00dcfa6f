"""Streamed training data (streaming: true): the rows and per-token losses of the cached path, a position that
resumes exactly with workers and across epochs, the mixture it delivers, and one line for what it cannot honour."""

from __future__ import annotations

import itertools
import json
import logging
import random

import pytest
import torch
from support import TINY_TEST_MODEL

from tunebook.config import ClassifyConfig, PretrainConfig, SFTConfig
from tunebook.data import PackedCollator, attention_inputs, prepare_sft_data, prepare_text_data
from tunebook.data.stream import reader_rows
from tunebook.errors import ConfigError, DataError

LOG = logging.getLogger("test")
WORDS = "the of and to in is was for on that with as by at from his her it an were are which this be".split()


def _corpus(folder, files=2, rows=60, seed=0):
    """A folder of JSONL shards, as a corpus is split for streaming (train-00000-of-00002.jsonl, ...)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        with open(folder / f"train-{i:05d}-of-{files:05d}.jsonl", "w") as f:
            for _ in range(rows):
                f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))}) + "\n")
    return folder


def _chat(path, rows=80, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 14)))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Reverse {digits}"},
                                             {"role": "assistant", "content": digits[::-1]}]}) + "\n")  # fmt: skip
    return path


@pytest.fixture
def tokenizer_dir(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save_pretrained(tmp_path / "tokenizer")
    return str(tmp_path / "tokenizer")


def _pretrain(tmp_path, tokenizer_dir, train_data, **overrides):
    options = {"tokenizer_name_or_path": tokenizer_dir, "max_seq_length": 32, "cache_dir": str(tmp_path / "cache"),
               "max_steps": 10, "per_device_train_batch_size": 4, "model_config": TINY_TEST_MODEL}  # fmt: skip
    return PretrainConfig(train_data=train_data, **{**options, **overrides})


def _rows(loader, count):
    return [b for b in itertools.islice(iter(loader), count)]


def _token_losses(batch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunebook.training import causal_lm_token_losses

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TINY_TEST_MODEL, "vocab_size": 512}))
    with torch.no_grad():
        return causal_lm_token_losses(model, attention_inputs(batch, "eager", torch.float32), batch)[0]


def _loader(data, config, workers=0):
    from tunebook.data import train_and_eval_loaders

    collate = PackedCollator(data.tokenizer.pad_token_id, None)
    config.dataloader_num_workers = workers
    return train_and_eval_loaders(config, data.stream, None, collate)[0]


def test_streamed_pretrain_rows_and_token_losses_equal_the_cached_path(tmp_path, tokenizer_dir):
    folder = _corpus(tmp_path / "corpus")
    cached = prepare_text_data(_pretrain(tmp_path, tokenizer_dir, str(folder)), tmp_path / "cache", LOG)
    config = _pretrain(tmp_path, tokenizer_dir, {"path": str(folder), "streaming": True}, stream_shuffle=False)
    streamed = prepare_text_data(config, tmp_path / "cache", LOG)
    assert len(list((tmp_path / "cache" / "prepared").iterdir())) == 1  # the cached run's: no copy of the stream
    full = len(cached.train) - 1  # the cached corpus ends with a short row; the stream finishes it from its next pass
    batches = _rows(_loader(streamed, config), -(-full // 4))
    rows = [r.tolist() for b in batches for r in b["input_ids"]][:full]
    assert rows == cached.train["input_ids"][:full]
    collate = PackedCollator(cached.tokenizer.pad_token_id, None)
    for b, batch in enumerate(batches[:3]):
        same = collate([cached.train[i] for i in range(4 * b, 4 * b + 4)])
        assert torch.equal(batch["labels"], same["labels"]) and torch.equal(batch["seq_ids"], same["seq_ids"])
        assert torch.equal(_token_losses(batch), _token_losses(same))


def test_streamed_sft_packing_equals_the_cached_packing(tmp_path, tokenizer_dir):
    path = _chat(tmp_path / "chat.jsonl")
    common = {"tokenizer_name_or_path": tokenizer_dir, "max_seq_length": 48, "cache_dir": str(tmp_path / "cache"),
              "packing": True, "max_steps": 5, "per_device_train_batch_size": 4, "model_config": TINY_TEST_MODEL}  # fmt: skip
    cached = prepare_sft_data(SFTConfig(train_data=str(path), **common), tmp_path / "cache", LOG)
    config = SFTConfig(train_data={"path": str(path), "streaming": True}, packing_buffer_size=80,
                       stream_shuffle=False, **common)  # fmt: skip
    streamed = prepare_sft_data(config, tmp_path / "cache", LOG)
    # One buffer holds the whole file: best-fit decreasing packs it into the cached path's rows, in its order.
    assert streamed.train["input_ids"] == cached.train["input_ids"][: len(streamed.train)]
    loader = _loader(streamed, config)
    collate = PackedCollator(cached.tokenizer.pad_token_id, None)
    for b, batch in enumerate(_rows(loader, 3)):
        same = collate([cached.train[i] for i in range(4 * b, 4 * b + 4)])
        assert torch.equal(batch["input_ids"], same["input_ids"]) and torch.equal(batch["labels"], same["labels"])
        assert torch.equal(_token_losses(batch), _token_losses(same))


def test_streamed_split_turns_equals_the_cached_split_turns(tmp_path, tokenizer_dir):
    """Two turns per conversation, each its own example: the stream makes the cached path's examples."""
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Reverse {n}"}, {"role": "assistant", "content": str(n)[::-1]},
                          {"role": "user", "content": "Again"}, {"role": "assistant", "content": str(n)}]}
            for n in range(1000, 1040)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = {"tokenizer_name_or_path": tokenizer_dir, "max_seq_length": 64, "cache_dir": str(tmp_path / "cache"),
              "packing": True, "max_steps": 5, "per_device_train_batch_size": 4, "model_config": TINY_TEST_MODEL,
              "split_turns": True}  # fmt: skip
    cached = prepare_sft_data(SFTConfig(train_data=str(path), **common), tmp_path / "cache", LOG)
    assert cached.stats["conversations_read"] == 40 and cached.stats["examples_read"] == 80
    config = SFTConfig(train_data={"path": str(path), "streaming": True}, packing_buffer_size=40,
                       stream_shuffle=False, eval_data=str(path), **common)  # fmt: skip
    streamed = prepare_sft_data(config, tmp_path / "cache", LOG)
    assert streamed.eval_examples.column_names == ["input_ids", "labels", "prompt_length"]  # no conversation_id
    # The preview runs on into the next pass; its first rows are the cached path's.
    assert streamed.train["input_ids"][: len(cached.train)] == cached.train["input_ids"]


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_streamed_sft_counts_truncated_and_dropped_examples_as_the_cached_path(tmp_path, tokenizer_dir, overlong):
    """What the cached path reports before training, a stream counts as its groups are trained on."""
    path = _chat(tmp_path / "chat.jsonl")
    common = {"tokenizer_name_or_path": tokenizer_dir, "max_seq_length": 36, "cache_dir": str(tmp_path / "cache"),
              "max_steps": 5, "per_device_train_batch_size": 4, "model_config": TINY_TEST_MODEL,
              "overlong_examples": overlong, "packing": True}  # fmt: skip
    cached = prepare_sft_data(SFTConfig(train_data=str(path), **common), tmp_path / "cache", LOG).stats
    config = SFTConfig(train_data={"path": str(path), "streaming": True}, packing_buffer_size=80, **common)
    loader = _loader(prepare_sft_data(config, tmp_path / "cache", LOG), config)
    rows = -(-cached["train_rows"] // 4)  # the first pass: one group of the file's 80 examples
    _rows(loader, rows)
    counts = dict(zip(("examples_read", "truncated", "dropped_overlong", "dropped_no_loss_tokens"), loader.examples))
    assert counts == {"examples_read": 80, **{k: cached[k] for k in list(counts)[1:]}}
    assert counts["truncated"] + counts["dropped_overlong"] > 0  # the file has examples longer than 36 tokens


def test_stream_shuffle_permutes_each_group_the_same_way_every_time(tmp_path, tokenizer_dir):
    """Shuffled (the default), a pass yields the unshuffled pass's rows in another order, and the same order on
    every read: what lets a resumed reader skip the rows it delivered."""
    folder = str(_corpus(tmp_path / "corpus", files=1, rows=80))

    def first_pass(shuffle):
        config = _pretrain(tmp_path, tokenizer_dir, {"path": folder, "streaming": True}, stream_shuffle=shuffle)
        stream = prepare_text_data(config, tmp_path / "cache", LOG).stream
        rows = reader_rows(stream.open_stream, stream.make_rows, stream.group, 0, 1, shuffle_seed=stream.shuffle_seed)
        return [tuple(row["input_ids"]) for row, position in itertools.takewhile(lambda r: r[1]["epoch"] == 0, rows)]

    plain, shuffled = first_pass(False), first_pass(True)
    assert len(plain) > 20 and sorted(shuffled) == sorted(plain) and shuffled != plain
    assert first_pass(True) == shuffled


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_stream_continues_exactly_across_epochs(tmp_path, tokenizer_dir, workers):
    """A mixture of a 2-shard folder and a file, read by `workers` workers: stopped after 7 batches (mid-group, mid-
    round of workers) and resumed from its saved position, it yields the uninterrupted stream's next batches, past
    the end of the first pass; the tokens per source are counted on as if never stopped."""
    data = [{"path": str(_corpus(tmp_path / "a", rows=8)), "streaming": True, "weight": 3.0},
            {"path": str(_corpus(tmp_path / "b", files=1, rows=6, seed=1)), "streaming": True}]  # fmt: skip
    config = _pretrain(tmp_path, tokenizer_dir, data, max_steps=40)
    streamed = prepare_text_data(config, tmp_path / "cache", LOG)
    whole = _loader(streamed, config, workers)
    expected = _rows(whole, 30)  # 30 x 4 rows of 32 tokens: more than a pass over the corpus
    first = _loader(streamed, config, workers)
    _rows(first, 7)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = _loader(streamed, config, workers)
    resumed.load_state_dict(state)
    for got, want in zip(_rows(resumed, 23), expected[7:]):
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert resumed.tokens == whole.tokens and resumed.taken == 30
    assert min(p["epoch"] for p in resumed.positions.values()) >= 1  # every reader is into its second pass
    if workers:
        other = _loader(streamed, config, 0)
        with pytest.raises(ConfigError, match="dataloader_num_workers 2"):
            other.load_state_dict(state)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"max_steps": -1}, "a stream's length is not known, so num_train_epochs cannot be counted; set max_steps"),
        ({"eval_split_ratio": 0.1}, "eval_split_ratio with streaming: true"),
        ({"save_strategy": "epoch"}, "save_strategy: epoch with streaming: true"),
        ({"eval_data": {"path": "x.jsonl", "streaming": True}}, "eval_data: streaming: true is for train_data"),
    ],
)
def test_what_a_stream_cannot_honour_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        PretrainConfig(train_data={"path": "x.jsonl", "streaming": True}, **{"max_steps": 10, **overrides}).validate()


def test_streaming_errors_of_sources_and_recipes(tmp_path, tokenizer_dir):
    with pytest.raises(ConfigError, match="group_by_length with streaming: true"):
        SFTConfig(train_data={"path": "x.jsonl", "streaming": True}, max_steps=3, group_by_length=True).validate()
    with pytest.raises(ConfigError, match="read by the pretrain and sft recipes"):
        ClassifyConfig(train_data={"path": "x.jsonl", "streaming": True}, max_steps=3).validate()
    folder = _corpus(tmp_path / "c")
    for data, message in [
        ({"path": str(folder), "streaming": True, "samples": 10}, "streamed, so its size is not known"),
        ({"path": str(folder), "streaming": "yes"}, "streaming of .* must be true or false"),
        ([{"path": str(folder), "streaming": True}, str(folder)], "stream every source or none"),
        ({"path": str(folder), "streaming": True, "columns": {"text": "body"}}, "no column 'text' .*set text_column"),
    ]:
        with pytest.raises(DataError, match=message):
            prepare_text_data(_pretrain(tmp_path, tokenizer_dir, data), tmp_path / "cache", LOG)


def test_bad_rows_stop_with_one_line_naming_file_and_row(tmp_path, tokenizer_dir):
    folder = _corpus(tmp_path / "bad", files=1, rows=400)
    with open(next(folder.iterdir()), "a") as f:
        f.write('{"text": "cut off\n')
    with pytest.raises(DataError, match=r"could not read .*bad: JSON parse error.* in row 400$"):
        prepare_text_data(
            _pretrain(tmp_path, tokenizer_dir, {"path": str(folder), "streaming": True}), tmp_path / "cache", LOG
        )
    # A row that only fails once converted, past the rows read at start-up (datasets maps 1,000 at a time): raised
    # in a loader worker, it still arrives as one line naming the file and row, not as the worker's traceback.
    path = _chat(tmp_path / "chat.jsonl", rows=1200)
    with open(path, "a") as f:
        f.write(json.dumps({"messages": [{"role": "robot", "content": "beep"}]}) + "\n")
    config = SFTConfig(train_data={"path": str(path), "streaming": True}, tokenizer_name_or_path=tokenizer_dir,
                       max_steps=1000, packing_buffer_size=50, per_device_train_batch_size=4,
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    data = prepare_sft_data(config, tmp_path / "cache", LOG)
    from tunebook.data import PadCollator, train_and_eval_loaders

    config.dataloader_num_workers = 1
    loader = train_and_eval_loaders(config, data.stream, None, PadCollator(data.tokenizer.pad_token_id))[0]
    with pytest.raises(DataError, match=r"chat.jsonl, row 1201.*robot") as error:
        _rows(loader, 1000)
    assert "\n" not in str(error.value)


def test_prepare_on_a_streamed_config_counts_no_rows_it_did_not_make(tmp_path, tokenizer_dir, capsys):
    from tunebook.cli.main import prepare

    folder = _corpus(tmp_path / "corpus", files=1, rows=20)
    figures = prepare(["--recipe", "pretrain", "--train_data", json.dumps({"path": str(folder), "streaming": True}),
                       "--tokenizer_name_or_path", tokenizer_dir, "--max_seq_length", "32", "--max_steps", "5",
                       "--cache_dir", str(tmp_path / "cache"), "--log_level", "WARNING"])  # fmt: skip
    assert figures["train_rows"].startswith("streamed") and figures["train_tokens"] is None
    assert "streamed (made as training reads them)" in capsys.readouterr().out


def test_prepared_shards_stream_the_cached_rows_without_tokenising(tmp_path, tokenizer_dir, capsys):
    from tunebook.cli.main import prepare

    folder = _corpus(tmp_path / "corpus", files=1, rows=120)
    args = ["--recipe", "pretrain", "--train_data", str(folder), "--tokenizer_name_or_path", tokenizer_dir,
            "--max_seq_length", "32", "--cache_dir", str(tmp_path / "cache"), "--log_level", "WARNING"]  # fmt: skip
    figures = prepare([*args, "--num_shards", "3", "--output", str(tmp_path / "shards")])
    assert sorted(p.name for p in (tmp_path / "shards").glob("*.arrow")) == [
        f"train-0000{i}-of-00003.arrow" for i in range(3)
    ]
    cached = prepare_text_data(_pretrain(tmp_path, tokenizer_dir, str(folder)), tmp_path / "cache", LOG)
    # Another node: its own empty cache, no tokenizer named (the shards carry theirs), nothing tokenised.
    config = _pretrain(tmp_path, None, {"path": str(tmp_path / "shards"), "streaming": True},
                       cache_dir=str(tmp_path / "node-cache"), stream_shuffle=False)  # fmt: skip
    streamed = prepare_text_data(config, tmp_path / "node-cache", LOG)
    assert streamed.built == [] and not (tmp_path / "node-cache" / "prepared").exists()
    rows = [r.tolist() for b in _rows(_loader(streamed, config), 10) for r in b["input_ids"]]
    assert rows == cached.train["input_ids"][:40] and figures["train_rows"] == len(cached.train)
    with pytest.raises(ConfigError, match="prepared with max_seq_length 32 and this run has 64; set max_seq_length"):
        prepare_text_data(_pretrain(tmp_path, None, config.train_data, max_seq_length=64), tmp_path / "c", LOG)
