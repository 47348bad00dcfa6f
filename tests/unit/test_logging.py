from __future__ import annotations

import logging
import time
import warnings

import pytest

from tunebook.logging import RunTimer, data_wait_advice, progress_bar, setup_logging, show_progress
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
    assert 0.12 <= timer.data_wait_seconds < 2.0  # six 20 ms waits (more on a loaded machine)
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


def test_data_wait_advice_names_the_setting_to_change():
    assert data_wait_advice(0.04, 2, 2) is None
    assert "set dataloader_num_workers (now 0) to 2" in data_wait_advice(0.3, 0, 2)
    assert "raise dataloader_num_workers (now 2) or dataloader_prefetch_factor (now 2)" in data_wait_advice(0.06, 2, 2)


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], logging.getLogger("tunebook").level
    yield
    root.handlers[:] = handlers
    logging.getLogger("tunebook").setLevel(level)
    logging.captureWarnings(False)


def test_other_processes_log_only_errors_and_what_is_marked_for_all_ranks(restore_logging, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    log = setup_logging(is_main_process=False)
    log.info("info from every rank")
    log.warning("the same warning on every rank")
    warnings.warn("a library warning", UserWarning, stacklevel=1)
    log.warning("only this rank's disk is full", extra={"all_ranks": True})
    log.error("rank 3 failed")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == [
        "[rank 3] WARNING tunebook: only this rank's disk is full",
        "[rank 3] ERROR tunebook: rank 3 failed",
    ]
    log = setup_logging(is_main_process=True, level="WARNING")
    log.info("not at WARNING level")
    log.warning("the same warning on every rank")
    warnings.warn("a library warning", UserWarning, stacklevel=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(" WARNING tunebook: the same warning on every rank") and "[rank" not in lines[0]
    assert "WARNING py.warnings" in lines[1] and "a library warning" in lines[1]
    assert not any("INFO" in line for line in lines)


def test_progress_is_a_log_line_without_a_bar(restore_logging, capsys):
    log = setup_logging(is_main_process=True)
    record = {"step": 4, "loss": 1.23456, "learning_rate": 1e-4, "tokens_per_second": 12345.6, "mfu": 0.4}
    bar = progress_bar(True, disable=True, total=10)  # disable_tqdm (a pipe, not a TTY, gives the same)
    show_progress(bar, record, 10, log)
    assert capsys.readouterr().out.strip().endswith("Step 4/10: loss 1.2346, lr 1.00e-04, tok/s 12,346, mfu 40.0%")
    assert progress_bar(False, disable=False, total=10).disable  # never on other processes
    assert progress_bar(True, disable=False, total=10).disable  # pytest's output is not a TTY
