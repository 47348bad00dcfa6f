"""recipes/dpo.py end to end: the embedded default raises held-out reward accuracy; the three kinds of reference."""

from __future__ import annotations

import json
import math

import pytest
from support import TINY_TEST_MODEL, assert_png, launch

pytestmark = pytest.mark.slow
SMALL = [
    "--model_config", json.dumps(TINY_TEST_MODEL),
    *"""--disable_tqdm true --synthetic_train_size 200 --synthetic_eval_size 24 --sft_warmup_steps 20 --max_steps 4
    --logging_steps 2 --per_device_train_batch_size 8 --per_device_eval_batch_size 8
    --dataloader_num_workers 0""".split(),
]  # fmt: skip


def _run(tmp_path, name, args, accelerate_config="cpu.yaml", launcher="tunebook"):
    out = tmp_path / name
    result = launch("recipes/dpo.py", [*args, "--output_dir", str(out)], accelerate_config, launcher=launcher)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, json.loads((out / "summary.json").read_text()), result


def test_default_raises_reward_accuracy_on_held_out_pairs(tmp_path):
    out, summary, result = _run(tmp_path, "default", ["--disable_tqdm", "true"], launcher="accelerate")
    before, after = summary["eval_before_training"], summary["eval"]
    # Before training the policy is its reference: every implicit reward is 0 and the loss is log 2.
    assert before["eval_loss"] == pytest.approx(math.log(2), abs=1e-6) and before["eval_rewards/accuracy"] == 0
    assert after["eval_rewards/accuracy"] >= 0.7, after  # measured 0.80
    assert after["eval_rewards/margin"] > 0 and after["eval_loss"] < math.log(2)
    assert summary["reference"] == "copy" and "SFT warm-up step 150/150" in result.stdout
    # One pair in the log, only the responses marked as loss-bearing.
    shown = result.stdout.split("One training pair, loss-bearing text in [[...]]:\n", 1)[1]
    chosen, rejected = shown.split(" INFO tunebook: ", 1)[0].split("\nrejected: ", 1)
    assert chosen.startswith("chosen:   <|im_start|>user\n") and "<|im_start|>assistant\n[[" in chosen
    assert rejected.startswith("<|im_start|>user\n") and rejected.count("[[") == 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "rewards/accuracy" in r and "eval_loss" not in r]
    assert [r["step"] for r in train] == list(range(10, 101, 10))
    assert {"loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "tokens_per_second"} <= set(train[-1])
    assert_png(out / "report.png")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)


def test_lora_reference_is_the_policy_with_adapters_off_on_two_processes(tmp_path):
    out, summary, _ = _run(tmp_path, "lora", [*SMALL, "--use_peft", "true"], accelerate_config="multi_cpu.yaml")
    assert summary["reference"] == "adapters off" and summary["num_processes"] == 2
    assert summary["eval_before_training"]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert summary["eval"]["eval_pairs"] == 24  # every held-out pair once, whatever the process count
    assert summary["trainable_parameters"] < summary["total_parameters"]
    assert json.loads((out / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"


def test_precomputed_reference_is_cached_with_the_data(tmp_path):
    first, summary, _ = _run(tmp_path, "pre1", [*SMALL, "--precompute_ref_log_probs", "true"])
    assert summary["reference"] == "precomputed"
    assert summary["eval_before_training"]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    _, again, result = _run(tmp_path, "pre2", [*SMALL, "--precompute_ref_log_probs", "true"])
    assert "Reference log-probabilities loaded from the cache" in result.stdout
    assert again["eval"]["eval_loss"] == pytest.approx(summary["eval"]["eval_loss"], abs=1e-6)
