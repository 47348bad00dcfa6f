"""The run record: the run's clock (training time without pauses, data wait) and the advice it gives."""

from __future__ import annotations

import time

from tunebook.run.record import RunTimer, data_wait_advice
from tunebook.training import accumulation_windows


def _slow_batches(n, delay):
    for i in range(n):
        time.sleep(delay)
        yield i


def test_data_wait_is_measured_and_paused_time_is_not_training_time():
    timer = RunTimer()
    timer.start_training()
    windows = list(accumulation_windows(_slow_batches(6, 0.02), 2, timer))
    assert windows == [[0, 1], [2, 3], [4, 5]]
    # Six 20 ms waits (more on a loaded machine): the first is the loader's start-up, reported on its own.
    assert 0.1 <= timer.data_wait_seconds < 2.0 and timer.first_batch_seconds >= 0.02
    with timer.paused():
        time.sleep(0.2)  # an evaluation: neither training time nor data wait
    assert timer.paused_seconds >= 0.2
    assert timer.train_runtime() < timer.data_wait_seconds + 0.1  # the paused 0.2 s is not training time
    assert timer.data_wait_fraction() > 0.6  # the loop did nothing but wait
    seconds, waited = timer.window()
    assert waited / seconds > 0.6
    assert seconds < timer.data_wait_seconds + 0.1  # the paused time excluded
    time.sleep(0.05)
    seconds, waited = timer.window()  # the next window starts where the last ended
    assert 0.05 <= seconds < 0.5 and waited == 0


def test_an_evaluation_before_training_is_not_subtracted_from_the_training_time():
    timer = RunTimer()
    with timer.paused():
        time.sleep(0.2)  # eval_on_start: before the training clock starts
    timer.start_training()
    time.sleep(0.05)
    assert 0.05 <= timer.train_runtime() < 0.2  # was 0.05 - 0.2 < 0: negative tokens/s, no MFU in summary.json


def test_data_wait_advice_names_the_setting_to_change():
    assert data_wait_advice(0.04, 2, 2) is None
    assert "set dataloader_num_workers (now 0) to 2" in data_wait_advice(0.3, 0, 2)
    assert "raise dataloader_num_workers (now 2) or dataloader_prefetch_factor (now 2)" in data_wait_advice(0.06, 2, 2)
    streamed = data_wait_advice(0.2, 2, 2, streamed=True)  # the workers tokenise: more of them, or files to share
    assert "raise dataloader_num_workers (now 2): each worker tokenises" in streamed
    assert "a multiple of processes x workers files" in streamed and "tunebook prepare" in streamed
