"""`sample_prompts` in every causal-LM recipe: replies at every evaluation in the log, metrics.jsonl, the tracker and
the model card, on one process and two, and nothing else of the run changes."""

from __future__ import annotations

import json

import pytest
from recipe_runs import _records, _run, _signal_at, _weights, _without_rates
from support import TINY_TEST_MODEL, launch

pytestmark = pytest.mark.slow


def _plain(record: dict) -> dict:
    return {k: v for k, v in _without_rates(record).items() if k != "samples"}


@pytest.mark.parametrize("name", ["sft", "pretrain", "dpo", "grpo"])
def test_samples_at_every_evaluation_leave_the_run_as_it_was(name, tmp_path):
    evaluated = {"eval_steps": 3, "eval_on_start": True}
    _run(name, tmp_path / "plain", tmp_path / "cache", **evaluated)
    _run(name, tmp_path / "sampled", tmp_path / "cache", **evaluated, sample_prompts=["12345", "hello"],
         sample_max_new_tokens=4)  # fmt: skip
    plain, sampled = _records(tmp_path / "plain"), _records(tmp_path / "sampled")
    with_samples = [r for r in sampled if "samples" in r]
    assert [r["step"] for r in with_samples] == [0, 3, 6]  # before training, then each evaluation
    for record in with_samples:
        assert [s["prompt"] for s in record["samples"]] == ["12345", "hello"]
        assert all(isinstance(s["completion"], str) for s in record["samples"])
    # Greedy generation in eval mode: the same losses, evaluations and weights as without it.
    assert [_plain(r) for r in sampled] == [_plain(r) for r in plain]
    assert _weights(tmp_path / "sampled") == _weights(tmp_path / "plain")


def test_a_run_with_samples_stopped_and_resumed_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    sampled = {"eval_steps": 2, "sample_prompts": ["12345"], "sample_max_new_tokens": 4}
    _run("sft", tmp_path / "full", tmp_path / "cache", **sampled)
    with monkeypatch.context() as patch:
        _signal_at(patch, "sft", 3)
        with pytest.raises(SystemExit):
            _run("sft", tmp_path / "cut", tmp_path / "cache", **sampled)
    _run("sft", tmp_path / "cut", tmp_path / "cache", **sampled, resume_from_checkpoint="latest")
    full, cut = _records(tmp_path / "full"), _records(tmp_path / "cut")
    assert [_without_rates(r) for r in cut] == [_without_rates(r) for r in full]  # the samples too
    assert [r["step"] for r in cut if "samples" in r] == [2, 4, 6]
    assert _weights(tmp_path / "cut") == _weights(tmp_path / "full")


SMALL = ["--model_config", json.dumps(TINY_TEST_MODEL), "--disable_tqdm", "true", "--synthetic_train_size", "300",
         "--synthetic_eval_size", "20", "--max_steps", "6", "--eval_steps", "3", "--per_device_train_batch_size", "8",
         "--generation_max_new_tokens", "4", "--sample_prompts", '["12345"]', "--sample_max_new_tokens", "6"]  # fmt: skip


def test_sft_command_line_samples_reach_the_log_metrics_tensorboard_and_model_card(tmp_path):
    out = tmp_path / "run"
    result = launch("recipes/sft.py", [*SMALL, "--report_to", "tensorboard", "--output_dir", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [r for r in _records(out) if "samples" in r]
    assert [r["step"] for r in records] == [0, 3, 6]
    completions = [r["samples"][0]["completion"] for r in records]
    for label, completion in zip(["Before training", "Step 3", "Final evaluation"], completions):
        assert f"INFO tunebook: {label}: " in result.stdout
        assert f"INFO tunebook:   sample '12345' -> {completion!r}\n" in result.stdout

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "runs" / "sft")).Reload()
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors("samples/text_summary")]
    assert [step for step, _ in texts] == [0, 3, 6]
    assert all(text.startswith("| prompt | completion |") and "| 12345 |" in text for _, text in texts)

    card = (out / "README.md").read_text()
    assert "## Sample generations" in card and "| prompt | before training | step 6 |" in card


def test_two_processes_answer_the_sample_prompts_once_in_the_record(tmp_path):
    out = tmp_path / "two"
    args = [*SMALL, "--per_device_train_batch_size", "4", "--report_to", "none", "--output_dir", str(out)]
    result = launch("recipes/sft.py", args, accelerate_config="multi_cpu.yaml")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [r for r in _records(out) if "samples" in r]
    assert [r["step"] for r in records] == [0, 3, 6] and all(len(r["samples"]) == 1 for r in records)
    assert (result.stdout + result.stderr).count("sample '12345' -> ") == 3  # the main process logs
