"""Offline, tiny, fast: shared fixtures and guards for the whole suite."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# Set before transformers/datasets are imported anywhere in the test session.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
ASSETS = Path(__file__).parent / "assets"

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


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tunebook.data.synthetic import SYNTHETIC_TASKS
    from tunebook.models import train_chat_tokenizer

    texts = [
        f"system\nuser\nassistant\n{t}\n0123456789 hello world, what is two plus two? four." for t in SYNTHETIC_TASKS
    ]
    return train_chat_tokenizer(texts * 20, vocab_size=300)


TINY_TEST_MODEL = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


@pytest.fixture
def tiny_model_config() -> dict:
    return dict(TINY_TEST_MODEL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_png(path) -> None:
    """`path` is a PNG image that matplotlib reads back, of a plausible size."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    height, width, _ = imread(path).shape
    assert width >= 600 and height >= 400, (width, height)


def launch_command(
    script: str,
    args: list[str],
    accelerate_config: str = "cpu.yaml",
    launcher_args: tuple[str, ...] = (),
    launcher: str = "tunebook",
) -> list[str]:
    """`tunebook train` (or, with `launcher="accelerate"`, `accelerate launch`) `--config_file
    accelerate_configs/<cfg> <script> <args>` as an argument list.

    `tunebook train` is what the README shows: `accelerate launch` with one process run in the launcher's own
    interpreter, which saves every single-process test launch a second interpreter and its imports (~2.5 s) and the
    interpreter's teardown (~1 s). Each recipe's default-run test keeps `accelerate launch`, so that stays tested."""
    entry = {"tunebook": ["tunebook.cli", "train"], "accelerate": ["accelerate.commands.launch"]}[launcher]
    return [
        sys.executable,
        "-m",
        *entry,
        "--quiet",
        "--config_file",
        str(ROOT / "accelerate_configs" / accelerate_config),
        "--main_process_port",
        str(free_port()),
        *launcher_args,
        str(ROOT / script),
        *args,
    ]


def launch(
    script: str,
    args: list[str],
    accelerate_config: str = "cpu.yaml",
    timeout: int = 300,
    env=None,
    launcher_args: tuple[str, ...] = (),
    launcher: str = "tunebook",
):
    """Run `launch_command(...)` and return the CompletedProcess."""
    cmd = launch_command(script, args, accelerate_config, launcher_args, launcher)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


def base_tokenizer(eos: str = "<|endoftext|>", extra: tuple[str, ...] = ()):
    """A base model's tokenizer: byte-level BPE, an EOS token, no chat template, no ChatML markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = ["user assistant question answer 0123456789 Reverse the digits. Sort the digits."] * 20
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[eos, *extra], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos)
