"""The one skeleton of data preparation (`data.pipeline`): the steps run in one order for every task, the held-out
split only without eval data, streaming only for the tasks that stream; and each task's data keeps its cache."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from tunebook.data.pipeline import Pipeline, PreparedData, Tokenised

log = logging.getLogger("test")


@dataclass(kw_only=True)
class ToyData(PreparedData):
    held_out: bool = False


class Toy(Pipeline):
    def __init__(self, *args):
        super().__init__(*args)
        self.steps = []

    def write_synthetic(self, directory, num_train, num_eval, seed):
        self.steps.append("synthetic")
        directory.mkdir(parents=True, exist_ok=True)
        for name in ("train", "eval"):
            (directory / f"{name}.jsonl").write_text('{"text": "x"}\n')
        return directory / "train.jsonl", directory / "eval.jsonl"

    def make_tokenizer(self):
        self.steps.append("tokenizer")
        return "tokenizer"

    def tokenise(self, sources, name):
        self.steps.append(f"tokenise {name} ({len(sources)} sources)")
        self.built.append(f"{name} tokenisation")
        return Tokenised([name], f"key-{name}", {"split": name})

    def split(self, train):
        self.steps.append("split")
        return train, Tokenised(["held"], train.key, {})

    def finish(self, train, evaluation):
        self.steps.append("finish")
        return ToyData(tokenizer=self.tokenizer, train=train.dataset, eval=evaluation and evaluation.dataset,
                       stats=train.stats, held_out=evaluation is not None and evaluation.dataset == ["held"])  # fmt: skip

    def streamed(self):
        self.steps.append("streamed")
        return ToyData(tokenizer="streamed tokenizer", train=[], eval=None, stream="stream")


def _config(tmp_path, train=None, eval_data=None, ratio=0.0):
    return SimpleNamespace(train_data=train, eval_data=eval_data, eval_split_ratio=ratio, synthetic_train_size=4,
                           synthetic_eval_size=2, seed=0)  # fmt: skip


def test_the_steps_run_in_one_order_and_the_data_carries_what_was_built(tmp_path):
    toy = Toy(_config(tmp_path, ratio=0.5), tmp_path, log)
    data = toy.prepare()
    # The generated default comes with its eval data: nothing is held out, whatever eval_split_ratio says.
    assert toy.steps == ["synthetic", "tokenizer", "tokenise train (1 sources)", "tokenise eval (1 sources)", "finish"]
    assert (data.tokenizer, data.train, data.eval, data.held_out) == ("tokenizer", ["train"], ["eval"], False)
    assert data.built == ["train tokenisation", "eval tokenisation"] and data.seconds > 0 and data.stream is None


@pytest.mark.parametrize("ratio", [0.0, 0.25])
def test_eval_data_is_held_out_only_without_eval_data_and_with_a_ratio(tmp_path, ratio):
    (tmp_path / "train.jsonl").write_text('{"text": "x"}\n')
    toy = Toy(_config(tmp_path, train=str(tmp_path / "train.jsonl"), ratio=ratio), tmp_path, log)
    data = toy.prepare()
    assert toy.holds_out == (ratio > 0)
    assert toy.steps == ["tokenizer", "tokenise train (1 sources)", *(["split"] if ratio else []), "finish"]
    assert data.eval == (["held"] if ratio else None)


def test_streamed_train_data_goes_to_the_tasks_stream_only_where_the_task_streams(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "x"}\n')
    streamed = [{"path": str(tmp_path / "train.jsonl"), "streaming": True}]
    toy = Toy(_config(tmp_path, train=streamed), tmp_path, log)
    toy.prepare()
    assert "streamed" not in toy.steps  # a task that does not stream: its usual steps
    toy = Toy(_config(tmp_path, train=streamed), tmp_path, log)
    toy.streams = True
    data = toy.prepare()
    assert toy.steps == ["streamed"] and data.stream == "stream" and data.built == []


def test_every_tasks_data_is_prepared_data():
    from tunebook.data import ClassificationData, SFTData, TextData
    from tunebook.preference import PreferenceData
    from tunebook.rl import PromptData

    for cls in (SFTData, ClassificationData, TextData, PreferenceData, PromptData):
        assert issubclass(cls, PreparedData)
