from __future__ import annotations

import logging
import warnings

import pytest

from tunebook.progress import progress_bar
from tunebook.run.logging import setup_logging, show_progress


@pytest.fixture
def restore_logging():
    root, own = logging.getLogger(), logging.getLogger("tunebook")
    handlers, own_handlers, level = root.handlers[:], own.handlers[:], own.level
    yield
    root.handlers[:], own.handlers[:] = handlers, own_handlers
    own.setLevel(level)
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
    log = setup_logging(is_main_process=True, level="WARNING", whole_process=True)
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


def test_a_caller_in_python_keeps_its_root_logger_and_warnings(restore_logging, capsys):
    root = logging.getLogger()
    handlers, level, showwarning = root.handlers[:], root.level, warnings.showwarning
    for _ in range(2):  # a notebook's second run replaces the first run's handler: each message once
        log = setup_logging(is_main_process=True, level="INFO", whole_process=False)
    log.info("from tunebook")
    assert capsys.readouterr().out.splitlines()[-1].endswith(" INFO tunebook: from tunebook")
    assert (root.handlers, root.level, warnings.showwarning) == (handlers, level, showwarning)
    assert len([h for h in log.handlers if getattr(h, "tunebook", False)]) == 1
