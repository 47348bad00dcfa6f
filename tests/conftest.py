"""Offline, tiny, fast: shared fixtures and guards for the whole suite."""

from __future__ import annotations

import os
import socket

import pytest

# Set before transformers/datasets are imported anywhere in the test session.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from support import TINY_TEST_MODEL, save_tiny_chat_model  # noqa: E402

_real_connect = socket.socket.connect


def _guarded_connect(self, address):
    host = address[0] if isinstance(address, tuple) else address
    if isinstance(host, str) and not (host.startswith("127.") or host in ("localhost", "::1") or host.startswith("/")):
        raise RuntimeError(f"test tried to open a network connection to {address!r}")
    return _real_connect(self, address)


@pytest.fixture(autouse=True)
def no_network(monkeypatch, tmp_path_factory):
    monkeypatch.setattr(socket.socket, "connect", _guarded_connect)
    # Each test session gets its own cache so results never depend on an earlier run's files.
    monkeypatch.setenv("TUNEBOOK_CACHE", str(tmp_path_factory.getbasetemp() / "tunebook-cache"))


@pytest.fixture(autouse=True)
def a_command_line_stays_in_its_test(monkeypatch):
    """A test that calls `tunebook.cli.main` in this process makes it a command's (`enter_command_line`: the
    excepthook, and `setup_logging` then takes the root logger): undone after the test, so that the next test's
    in-process run logs as a library caller's would (caplog sees its records)."""
    import sys

    from tunebook import errors

    monkeypatch.setattr(errors, "_COMMAND_LINE", [errors.owns_process()])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tunebook.data.synthetic import SYNTHETIC_TASKS
    from tunebook.models import train_chat_tokenizer

    texts = [
        f"system\nuser\nassistant\n{t}\n0123456789 hello world, what is two plus two? four." for t in SYNTHETIC_TASKS
    ]
    return train_chat_tokenizer(texts * 20, vocab_size=300)


@pytest.fixture
def tiny_model_config() -> dict:
    return dict(TINY_TEST_MODEL)


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory):
    """A saved tiny chat model that answers "hi" with `support.CHAT_REPLY` (trained once per session, ~2 s)."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-model"))
