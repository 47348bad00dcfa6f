"""Starting a `tunebook vllm-serve` server for the tests (a plain module: test modules import it)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

__all__ = ["free_port", "start_server", "stop"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, log_file, *extra: str) -> tuple[subprocess.Popen, int]:
    """A float32 server on a free local port, started and listening (or the test fails with its log)."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tunebook.cli", "vllm-serve", "--model", str(model_dir), "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", "--max-model-len", "128", "--seed", "0",
         "--gpu-memory-utilization", "0.1", *extra],
        stdout=subprocess.DEVNULL, stderr=open(log_file, "w"),
    )  # fmt: skip
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited ({server.returncode}): {open(log_file).read()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return server, port
        time.sleep(1.0)
    stop(server)
    pytest.fail("the server did not listen in time")


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=60)
