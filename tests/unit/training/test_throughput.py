"""Per-window throughput figures against the counts they come from."""

from __future__ import annotations

import time

import datasets
import pytest
import torch
from accelerate import Accelerator

from tunebook.models import build_causal_lm
from tunebook.run.record import RunTimer
from tunebook.training import Throughput, TrainCounters
from tunebook.training.flops import model_flops_per_token


def _padded_batch():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    return {"input_ids": torch.ones_like(mask), "attention_mask": mask}


def _packed_batch():
    # two rows: examples of 3 + 2 tokens, and 4 tokens + 1 padding position
    position_ids = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    return {"input_ids": torch.ones_like(mask), "attention_mask": mask, "position_ids": position_ids,
            "seq_ids": torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]])}  # fmt: skip


def test_counters_count_tokens_padding_and_examples():
    counters = TrainCounters.zeros("cpu")
    counters.add_batch(_padded_batch())
    assert (counters.tokens_seen.item(), counters.fed_tokens.item(), counters.samples_seen.item()) == (7, 10, 2)
    counters.add_batch(_packed_batch())  # 3 examples in 2 rows; the padding position's 0 is not an example
    assert (counters.tokens_seen.item(), counters.fed_tokens.item(), counters.samples_seen.item()) == (16, 20, 5)
    restored = TrainCounters.zeros("cpu")
    state = counters.state_dict()
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    del state["samples_seen"]  # a checkpoint written before the counter existed still loads
    restored.load_state_dict(state)
    assert restored.samples_seen.item() == 0


def test_throughput_window_rates_mfu_and_memory(tiny_tokenizer, tiny_model_config):
    accelerator = Accelerator(cpu=True)
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config)
    dataset = datasets.Dataset.from_dict({"input_ids": [[1] * 10, [1] * 10], "labels": [[-100] * 5 + [1] * 5] * 2})
    counters = TrainCounters.zeros("cpu")
    counters.add_batch(_padded_batch())  # seen before a resume: not part of the first window
    timer = RunTimer()
    meter = Throughput(accelerator, model, dataset, timer, counters, peak_flops=1e9)
    assert meter.flops_per_token == pytest.approx(model_flops_per_token(model, 10.0, 0.5))
    timer.start_training()
    counters.add_batch(_packed_batch())
    time.sleep(0.05)
    with timer.paused():  # an evaluation: not training time
        time.sleep(0.2)
    before = time.perf_counter()
    record = meter.window()
    assert record["train_tokens"] == 16
    seconds = 9 / record["tokens_per_second"]  # the 9 tokens of this window
    assert 0.05 <= seconds < 0.05 + (time.perf_counter() - before) + 0.1  # the paused 0.2 s excluded
    assert record["samples_per_second"] == pytest.approx(3 / seconds)
    assert record["mfu"] == pytest.approx(meter.flops_per_token * record["tokens_per_second"] / 1e9)
    assert record["peak_rss_mb"] > 0 and 0 <= record["data_wait_fraction"] <= 1
    counters.add_batch(_padded_batch())
    time.sleep(0.02)
    assert meter.window()["train_tokens"] == 23
    summary = meter.summary(tokens_per_second=100.0)
    assert summary["mfu"] == pytest.approx(meter.flops_per_token * 100.0 / 1e9)
    assert summary["attention_span"] == 10.0 and summary["peak_flops_per_device"] == 1e9
    assert "mfu" not in Throughput(accelerator, model, dataset, timer, counters).window()  # CPU, no peak_flops
