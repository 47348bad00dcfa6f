from __future__ import annotations

import logging
import warnings

import pytest

from tunebook.run.logging import progress_bar, setup_logging, show_progress


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
