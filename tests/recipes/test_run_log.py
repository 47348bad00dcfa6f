"""What a run prints, seen as a new user sees it: `tunebook train ... > run.log 2>&1`. A quiet start (no launcher,
library or deprecation noise, the setup in our words, no terminal escape codes in the file) and progress at least
every `log_every_seconds`, which leaves metrics.jsonl as it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import ROOT, TINY_TEST_MODEL, free_port

from recipe_runs import _records, _run, _without_rates  # isort: skip

# What a run printed before issue 44: accelerate's launcher warning, peft's deprecated call into transformers,
# transformers' coloured load report, accelerate's note at each checkpoint of a tied model, escape codes.
NOISE = (
    "were not passed to `accelerate launch`",
    "`accelerate config`",
    "is_gradient_checkpointing",
    "FutureWarning",
    "LOAD REPORT",
    "Removed shared tensor",
    "\x1b[",
    "\r",  # a progress bar's redraws (tqdm draws bars on a terminal only)
)
TINY = ["--disable_tqdm", "false", "--dataloader_num_workers", "0", "--synthetic_train_size", "64",
        "--synthetic_eval_size", "8", "--max_steps", "4", "--logging_steps", "2", "--eval_steps", "100"]  # fmt: skip


def _train(tmp_path, launcher_args: list[str], recipe: str, args: list[str], env: dict | None = None) -> str:
    """`tunebook train` in a process of its own, its output and errors in one log file, as a user's `> run.log 2>&1`
    makes it; returns the file's text."""
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "tunebook.cli", "train", *launcher_args, "--main_process_port", str(free_port()),
           recipe, "--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache"), *TINY, *args]  # fmt: skip
    # OMP_NUM_THREADS unset, as in a fresh shell: accelerate then picks the CPU threads itself (and warned of it).
    env = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log.open("w") as file:
        result = subprocess.run(cmd, stdout=file, stderr=subprocess.STDOUT, cwd=ROOT, timeout=300, env=env)
    text = log.read_text()
    assert result.returncode == 0, text[-4000:]
    return text


def _quiet(text: str) -> None:
    heard = [noise for noise in NOISE if noise in text]
    assert not heard, f"{heard} in the run's log:\n{text[:3000]}"


@pytest.mark.slow
def test_a_run_without_an_accelerate_config_starts_quietly_and_a_tied_model_checkpoints_quietly(tmp_path):
    # No --config_file and no default accelerate config (HF_HOME is empty): accelerate's defaults, passed to it.
    tied = json.dumps({**TINY_TEST_MODEL, "tie_word_embeddings": True})
    args = ["--model_config", tied, "--save_steps", "2", "--generation_eval", "false"]
    text = _train(tmp_path, [], "sft", args, {"HF_HOME": str(tmp_path / "hf_home")})
    _quiet(text)
    assert "INFO tunebook: Launch: single process on cpu, no mixed precision\n" in text
    assert "process(es), NO" not in text
    assert (tmp_path / "out" / "checkpoints" / "step-4").is_dir()  # two checkpoints were written, silently


@pytest.mark.slow
def test_a_lora_run_is_quiet(tmp_path):
    config = ["--config_file", str(ROOT / "accelerate_configs" / "cpu.yaml")]  # CPU threads: accelerate's default
    args = ["--model_config", json.dumps(TINY_TEST_MODEL), "--use_peft", "true", "--generation_eval", "false"]
    text = _train(tmp_path, config, "sft", args)
    _quiet(text)
    assert "Model: PeftModelForCausalLM" in text


@pytest.mark.slow
def test_a_classifier_from_a_pretrained_encoder_says_its_new_head_in_one_plain_line(tmp_path):
    from transformers import BertConfig, BertModel

    encoder = tmp_path / "encoder"
    BertModel(BertConfig(vocab_size=400, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(encoder)  # fmt: skip
    config = ["--config_file", str(ROOT / "accelerate_configs" / "cpu.yaml")]
    text = _train(tmp_path, config, "classify", ["--model_name_or_path", str(encoder)])
    _quiet(text)
    assert f"Not in {encoder}, so newly initialised (trained from a random start): classifier.bias, " in text


def test_a_timed_line_between_logging_steps_leaves_metrics_as_they_were(tmp_path, caplog):
    """With a tiny `log_every_seconds` every step between logging steps logs a line; without it only the first
    step does. The records of metrics.jsonl are the same either way (their rates aside, which are timings)."""
    runs = {}
    for name, seconds in (("timed", 1e-6), ("default", 30.0)):
        caplog.clear()
        _run("sft", tmp_path / name, tmp_path / "cache", logging_steps=3, log_every_seconds=seconds,
             log_level="INFO")  # fmt: skip
        lines = [r.getMessage() for r in caplog.records if r.name == "tunebook" and "loss so far" in r.getMessage()]
        runs[name] = lines
    timed = [line.split(":")[0] for line in runs["timed"]]
    assert timed == ["Step 1/6", "Step 2/6", "Step 4/6", "Step 5/6"], runs["timed"]  # 3 and 6 log their own lines
    assert [line.split(":")[0] for line in runs["default"]] == ["Step 1/6"]  # the first step's, at once
    assert all("tok/s" in line and "elapsed" in line and "ETA" in line for line in runs["timed"])
    timed_records, default_records = _records(tmp_path / "timed"), _records(tmp_path / "default")
    assert [r["step"] for r in timed_records if "loss" in r] == [3, 6]
    assert [_without_rates(r) for r in timed_records] == [_without_rates(r) for r in default_records]
