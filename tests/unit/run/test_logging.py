from __future__ import annotations

import logging
import warnings

import pytest

from tunebook.progress import progress_bar
from tunebook.run.logging import describe_processes, setup_logging, show_heartbeat, show_progress, strip_ansi


@pytest.fixture
def restore_logging():
    root, own, library = logging.getLogger(), logging.getLogger("tunebook"), logging.getLogger("transformers")
    handlers, own_handlers, level = root.handlers[:], own.handlers[:], own.level
    library_handlers, propagate, library_level = library.handlers[:], library.propagate, library.level
    yield
    root.handlers[:], own.handlers[:] = handlers, own_handlers
    library.handlers[:], library.propagate = library_handlers, propagate
    library.setLevel(library_level)
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


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        (("NO", 1), "single process"),
        (("MULTI_GPU", 4), "DDP, 4 processes"),
        (("MULTI_XPU", 2), "DDP, 2 processes"),
        (("MULTI_CPU", 2), "DDP on CPUs, 2 processes"),
        (("FSDP", 8, None, 1), "FSDP, 8 processes"),
        (("FSDP", 8, None, 2), "FSDP2, 8 processes"),
        (("DEEPSPEED", 8, 3), "DeepSpeed ZeRO-3, 8 processes"),
        (("DEEPSPEED", 1, 2), "DeepSpeed ZeRO-2, 1 process"),
        (("XLA", 8), "XLA, 8 processes"),
    ],
)
def test_the_distributed_setup_in_words(setup, words):
    assert describe_processes(*setup) == words


def test_the_start_up_line_says_it_in_words(restore_logging, capsys):
    from types import SimpleNamespace

    import torch

    from tunebook.config import SFTConfig
    from tunebook.run.logging import log_run_start

    accelerator = SimpleNamespace(
        num_processes=1, device=torch.device("cpu"), mixed_precision="bf16", state=SimpleNamespace(),
        distributed_type=SimpleNamespace(value="NO"),
    )  # fmt: skip
    log = setup_logging(is_main_process=True)
    log_run_start(log, SFTConfig(output_dir="out"), accelerator)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.endswith("INFO tunebook: Launch: single process on cpu, bf16 mixed precision"), line
    accelerator.mixed_precision = "no"
    log_run_start(log, SFTConfig(output_dir="out"), accelerator)
    assert capsys.readouterr().out.splitlines()[-1].endswith("single process on cpu, no mixed precision")


def test_log_lines_hold_no_terminal_escape_codes(restore_logging, capsys):
    coloured = "\x1b[1mBertForSequenceClassification LOAD REPORT\x1b[0m from: \x1b[31mMISSING\x1b[0m \x1b]8;;x\x07link\x1b]8;;\x07"
    assert strip_ansi(coloured) == "BertForSequenceClassification LOAD REPORT from: MISSING link"
    assert strip_ansi("plain [1m text [[0586]]") == "plain [1m text [[0586]]"  # brackets alone are text
    setup_logging(is_main_process=True, whole_process=True)
    logging.getLogger("transformers.modeling_utils").warning(coloured)  # a library's record, through our handler
    logging.getLogger("tunebook").info(coloured)
    out = capsys.readouterr().out
    assert "\x1b" not in out and out.count("BertForSequenceClassification LOAD REPORT from: MISSING") == 2


def test_a_timed_progress_line_is_a_log_line_without_a_bar(restore_logging, capsys):
    log = setup_logging(is_main_process=True)
    figures = {"loss so far": "4.1234", "tok/s": "2,500", "elapsed": "1m05s", "ETA": "38m12s"}
    show_heartbeat(progress_bar(True, disable=True, total=250), 7, 250, figures, log)
    line = capsys.readouterr().out.strip()
    assert line.endswith("INFO tunebook: Step 7/250: loss so far 4.1234, tok/s 2,500, elapsed 1m05s, ETA 38m12s")
