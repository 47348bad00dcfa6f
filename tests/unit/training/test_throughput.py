"""Per-window throughput figures against the counts they come from."""

from __future__ import annotations

import time

import datasets
import pytest
import torch
from accelerate import Accelerator

from tunebook.models import build_causal_lm
from tunebook.planning.flops import model_flops_per_token
from tunebook.run.record import RunTimer
from tunebook.training import Throughput, TrainCounters


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


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_heartbeat_after_the_first_step_then_after_each_silence_of_its_interval():
    from tunebook.training.throughput import Heartbeat

    clock = _Clock()
    beat = Heartbeat(30, RunTimer(), TrainCounters.zeros("cpu"), processes=1, step=0, clock=clock)
    seen = []
    # Steps of 7 s with logging_steps 10: the first step's line at once, then one whenever 30 s passed silently.
    for step in range(1, 26):
        clock.now += 7
        if beat.due(logged=step % 10 == 0):
            seen.append(step)
    # 1 at once; 6: 35 s after it (5 was 28 s); 10 logs itself, so 15 is the first 30 s after that, and 25 after 20.
    assert seen == [1, 6, 15, 25]
    # A logging step's own line restarts the silence: nothing for 29 s after it, a line at 30 s.
    beat = Heartbeat(30, RunTimer(), TrainCounters.zeros("cpu"), processes=1, step=0, clock=clock)
    assert beat.due(logged=True) is False
    clock.now += 29
    assert beat.due(logged=False) is False
    clock.now += 1
    assert beat.due(logged=False) is True


def test_heartbeat_figures_rate_elapsed_and_eta():
    from types import SimpleNamespace

    from tunebook.training.throughput import Heartbeat, format_duration

    counters = TrainCounters.zeros("cpu")
    counters.tokens_seen += 1000  # a resumed run's tokens before this session do not count
    timer = SimpleNamespace(train_start=time.perf_counter() - 125, train_runtime=lambda: 100.0)
    beat = Heartbeat(30, timer, counters, processes=2, step=40)
    counters.tokens_seen += 5000
    shown = beat.figures(step=50, total_steps=250, loss=1.23456)
    # 5000 tokens on this process x 2 processes in 100 s; 10 steps in 100 s, 200 to go.
    assert shown == {"loss so far": "1.2346", "tok/s": "100", "elapsed": "2m05s", "ETA": "33m20s"}
    assert beat.figures(step=50, total_steps=250, loss=None)["loss so far"] == "-"
    assert [format_duration(s) for s in (0.4, 42, 307, 3720, 90000)] == ["0s", "42s", "5m07s", "1h02m", "25h00m"]
