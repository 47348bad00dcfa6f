"""Streamed training data end to end: 2 processes with 2 loader workers each, stopped by SIGTERM and resumed, train
exactly as the uninterrupted run (losses, delivered mixture, weights); a streamed SFT run packs and evaluates."""

from __future__ import annotations

import json
import random

import pytest
from support import ROOT, TINY_TEST_MODEL, free_port

from tunebook.training.checkpoint import list_checkpoints

pytestmark = pytest.mark.slow
WORDS = "the of and to in is was for on that with as by at from his her it an were are which this be".split()


def _corpus(tmp_path):
    """A folder of 4 JSONL shards (whole shards per reader: 2 processes x 2 workers) and a second, 1-file source."""
    rng = random.Random(0)
    for name, files in (("web", 4), ("books", 1)):
        (tmp_path / name).mkdir()
        for i in range(files):
            with open(tmp_path / name / f"train-{i:05d}-of-{files:05d}.jsonl", "w") as f:
                for _ in range(30):
                    f.write(
                        json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))}) + "\n"
                    )
    return [{"path": str(tmp_path / "web"), "streaming": True, "weight": 0.75},
            {"path": str(tmp_path / "books"), "streaming": True, "weight": 0.25}]  # fmt: skip


def _records(out) -> list[dict]:
    rates = ("tokens_per_second", "samples_per_second", "data_wait_fraction", "peak_rss_mb", "mfu")
    return [{k: v for k, v in json.loads(line).items() if k not in rates} for line in open(out / "metrics.jsonl")]


@pytest.mark.multiprocess
def test_sigterm_then_resume_on_two_processes_with_workers_equals_the_uninterrupted_run(tmp_path):
    import os
    import subprocess
    import sys

    args = ["--model_config", json.dumps(TINY_TEST_MODEL), "--train_data", json.dumps(_corpus(tmp_path)),
            "--max_seq_length", "32", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
            "--max_steps", "10", "--logging_steps", "1", "--dataloader_num_workers", "2", "--disable_tqdm", "true",
            "--report_to", "none", "--log_level", "WARNING", "--cache_dir", str(tmp_path / "cache")]  # fmt: skip

    def launch(script, out, *extra, env=None):
        cmd = [sys.executable, "-m", "tunebook.cli", "train", "--config_file", "accelerate_configs/multi_cpu.yaml",
               "--main_process_port", str(free_port()), script, *args, "--output_dir", str(out), *extra]  # fmt: skip
        env = {**os.environ, "SIGNAL_RECIPE": "pretrain", **(env or {})}
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)

    full = launch("pretrain", tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    stopped = launch("tests/recipes/signal_at_step.py", tmp_path / "cut", env={"SIGNAL_AT_STEP": "3"})
    assert stopped.returncode == 143, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    assert [p.name for p in list_checkpoints(tmp_path / "cut")] == ["step-3"]
    resumed = launch("pretrain", tmp_path / "cut", "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = _records(tmp_path / "full")
    assert _records(tmp_path / "cut") == records and len(records) == 10
    assert {"mixture/web", "mixture/books"} <= set(records[-1])  # the delivered shares, logged at every step
    assert (tmp_path / "cut" / "model.safetensors").read_bytes() == (
        tmp_path / "full" / "model.safetensors"
    ).read_bytes()
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    delivered = summary["mixture_delivered"]
    assert delivered == json.loads((tmp_path / "cut" / "summary.json").read_text())["mixture_delivered"]
    assert delivered["web"]["tokens"] + delivered["books"]["tokens"] == summary["train_tokens"]
    assert not (tmp_path / "cache" / "prepared").exists()  # nothing of the stream was written as Arrow


def test_streamed_packed_sft_stopped_by_sigterm_resumes_exactly(tmp_path, monkeypatch):
    """In-process sft, 2 loader workers, packing over buffers of 40 examples, evaluation on cached eval_data."""
    from recipe_runs import _records as records
    from recipe_runs import _run, _signal_at, _weights, _without_rates

    rng = random.Random(0)
    for name, rows in (("train", 300), ("eval", 16)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for _ in range(rows):
                digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 14)))
                f.write(
                    json.dumps({"instruction": "Reverse the digits.", "input": digits, "output": digits[::-1]}) + "\n"
                )
    options = {"train_data": {"path": str(tmp_path / "train.jsonl"), "streaming": True}, "packing": True,
               "packing_buffer_size": 40, "max_seq_length": 64, "eval_data": str(tmp_path / "eval.jsonl"),
               "dataloader_num_workers": 2, "eval_steps": 2, "max_steps": 8}  # fmt: skip
    full = _run("sft", tmp_path / "full", tmp_path / "cache", **options)
    with monkeypatch.context() as patch:
        _signal_at(patch, "sft", 3)
        with pytest.raises(SystemExit):
            _run("sft", tmp_path / "cut", tmp_path / "cache", **options)
    resumed = _run("sft", tmp_path / "cut", tmp_path / "cache", **options, resume_from_checkpoint="latest")
    assert [_without_rates(r) for r in records(tmp_path / "cut")] == [
        _without_rates(r) for r in records(tmp_path / "full")
    ]
    assert _weights(tmp_path / "cut") == _weights(tmp_path / "full") and resumed["eval"] == full["eval"]
    assert resumed["mixture_delivered"] == full["mixture_delivered"]
    assert (
        resumed["streamed_examples"] == full["streamed_examples"] and full["streamed_examples"]["examples_read"] >= 40
    )
