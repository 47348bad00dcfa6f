"""One run per output directory: the lock's refusals, its release, and its end with its holder."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import ROOT, hold_lock

from tunebook.errors import ConfigError
from tunebook.run.output_lock import LOCK_NAME, lock_output_dir


def test_a_second_lock_names_the_holder_and_is_free_once_the_holder_dies(tmp_path):
    holder = hold_lock(tmp_path / "run")
    try:
        with pytest.raises(ConfigError) as refused:
            lock_output_dir(tmp_path / "run", "dpo")
        message = str(refused.value)
        assert (
            f"is in use by another run (sft run, PID {holder.pid} on host {socket.gethostname()}, started " in message
        )
        assert "\n" not in message
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up: the kernel releases a dead holder's lock
        holder.wait()
    with lock_output_dir(tmp_path / "run", "dpo") as lock:
        assert lock.held
        record = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
        assert record["pid"] == os.getpid() and record["recipe"] == "dpo"
    assert not lock.held


def test_a_released_lock_can_be_taken_by_another_process(tmp_path):
    lock = lock_output_dir(tmp_path / "run")
    lock.release()
    lock.release()  # idempotent
    holder = hold_lock(tmp_path / "run")  # would block (and fail its readline) if the release had not happened
    holder.kill()
    holder.wait()


def test_the_same_process_takes_over_its_own_earlier_runs_lock(tmp_path):
    """A notebook's run that failed keeps its lock while its traceback holds the frames; the next run of the same
    process (one run at a time) takes it over instead of refusing itself."""
    first = lock_output_dir(tmp_path / "run")
    second = lock_output_dir(tmp_path / "run")
    assert second.held and not first.held
    second.release()


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "model.safetensors").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"^output_dir \S*model.safetensors is a file, not a directory$"):
        lock_output_dir(tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"output_dir .*model.safetensors/run: .*model.safetensors is a file, not a"):
        lock_output_dir(tmp_path / "model.safetensors" / "run")


def test_a_read_only_file_system_is_one_line(tmp_path, monkeypatch):
    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ConfigError, match=r"^output_dir .*run cannot be created: read-only file system$"):
        lock_output_dir(tmp_path / "run")
    monkeypatch.undo()
    (tmp_path / "existing").mkdir()
    real_open = os.open

    def no_write(path, flags, *args):
        if str(path).endswith(LOCK_NAME):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_write)
    with pytest.raises(ConfigError, match=r"^output_dir .*existing cannot be written: read-only file system \("):
        lock_output_dir(tmp_path / "existing")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_second_launch_into_a_busy_output_dir_stops_every_process_with_one_line(tmp_path):
    """Through the real launcher, on two processes: both ranks stop before preparing data (the main process's
    verdict is broadcast), one line, exit 1, no hang; the running run's files are untouched."""
    holder = hold_lock(tmp_path / "run")
    try:
        (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
        cmd = [sys.executable, "-m", "tunebook.cli", "train", "--config_file", "accelerate_configs/multi_cpu.yaml",
               "sft", "--output_dir", str(tmp_path / "run"), "--cache_dir", str(tmp_path / "cache"),
               "--report_to", "none", "--disable_tqdm"]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("tunebook: error")]
    assert len(errors) == 1, output[-3000:]  # both ranks stop with it; the machine's first process prints it
    assert f"is in use by another run (sft run, PID {holder.pid} on host " in errors[0]
    assert "Traceback" not in output
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (tmp_path / "run" / "config.yaml").exists() and not (tmp_path / "cache").exists()


def test_two_runs_cannot_start_at_once(tmp_path):
    """Four processes race for one free output_dir: exactly one gets it (the winner holds it until killed)."""
    code = (
        "import sys, time\nfrom tunebook.run.output_lock import lock_output_dir\nfrom tunebook.errors import ConfigError\n"
        "try:\n    lock = lock_output_dir(sys.argv[1])\nexcept ConfigError:\n    print('refused', flush=True)\n"
        "else:\n    print('got', flush=True)\n    time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True, env=env
        )  # fmt: skip
        for _ in range(4)
    ]
    try:
        outcomes = sorted(r.stdout.readline().strip() for r in racers)
    finally:
        for racer in racers:
            racer.kill()
            racer.wait()
    assert outcomes == ["got", "refused", "refused", "refused"]


def test_a_forked_child_neither_keeps_nor_releases_the_lock(tmp_path):
    """A DataLoader worker is a fork of the run's process: killing the run frees the folder even while the worker
    lives on, and a worker that ends does not unlock its live parent's folder."""
    code = (
        "import os, sys, time\nfrom tunebook.run.output_lock import lock_output_dir\n"
        "lock = lock_output_dir(sys.argv[1])\nchild = os.fork()\n"
        "if child == 0:\n    time.sleep(float(sys.argv[2]))\n    os._exit(0)\n"
        "print(child, flush=True)\ntime.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    # A worker that ends at once: its parent still holds the lock.
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "a"), "0"], stdout=subprocess.PIPE,
                              text=True, env=env)  # fmt: skip
    parent.stdout.readline()
    time.sleep(0.5)
    with pytest.raises(ConfigError, match=f"PID {parent.pid} on host"):
        lock_output_dir(tmp_path / "a")
    parent.kill()
    parent.wait()
    # A worker that outlives its parent's kill -9: the lock is gone with the parent.
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "b"), "600"], stdout=subprocess.PIPE,
                              text=True, env=env)  # fmt: skip
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    try:
        with lock_output_dir(tmp_path / "b") as lock:
            assert lock.held
    finally:
        os.kill(child, signal.SIGKILL)
