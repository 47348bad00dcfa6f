"""recipes/dpo.py end to end: the embedded default raises held-out reward accuracy; the three kinds of reference;
each loss_type runs, from its known value before training."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from support import TINY_TEST_MODEL, assert_png, launch
from transformers import PreTrainedModel

import tunebook.preference.losses as preference
from tunebook import load_recipe

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


# Each loss_type: a short in-process run each, the reference-based losses' known value before training, and no
# reference model (no copy, no adapters-off pass) for simpo and orpo.
QUICK = {"disable_tqdm": True, "report_to": "none", "dataloader_num_workers": 0, "log_level": "WARNING",
         "model_config": TINY_TEST_MODEL, "synthetic_train_size": 64, "synthetic_eval_size": 8, "sft_warmup_steps": 0,
         "max_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 4, "per_device_eval_batch_size": 8,
         "save_strategy": "no"}  # fmt: skip


def _run_in_process(tmp_path, name, **overrides):
    """The run's summary (its logged figures checked), the forwards it ran (`sequence_log_probs` calls) per policy
    forward, and the models it deep-copied."""
    forwards, evaluations, copied = [], [], []
    sequence_log_probs, deepcopy = preference.sequence_log_probs, copy.deepcopy

    def counted(model, *args, **kwargs):
        forwards.append(model)
        return sequence_log_probs(model, *args, **kwargs)

    def watched(value, *args, **kwargs):
        if isinstance(value, PreTrainedModel):
            copied.append(type(value).__name__)
        return deepcopy(value, *args, **kwargs)

    dpo = load_recipe("dpo")
    evaluate = dpo.module.evaluate_preferences

    def evaluated(*args, **kwargs):
        evaluations.append(kwargs["loss_type"])
        return evaluate(*args, **kwargs)

    out = tmp_path / name
    config = dpo.config(**{**QUICK, **overrides}, output_dir=str(out), cache_dir=str(tmp_path / "cache"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(preference, "sequence_log_probs", counted)
        patch.setattr(copy, "deepcopy", watched)
        patch.setattr(dpo.module, "evaluate_preferences", evaluated)
        summary = dpo.main(config)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "rewards/accuracy" in r and "eval_loss" not in r]
    assert len(train) == 2 and all(math.isfinite(r["loss"]) for r in train)
    assert {"rewards/chosen", "rewards/rejected", "rewards/margin"} <= set(train[-1])
    assert math.isfinite(summary["eval"]["eval_loss"]) and summary["eval"]["eval_pairs"] == 8
    assert set(evaluations) == {config.loss_type}  # evaluation measures the loss training uses
    # 2 training micro-batches, and one batch (8 pairs) per evaluation.
    policy_forwards = 2 * config.gradient_accumulation_steps + len(evaluations)
    assert len(forwards) % policy_forwards == 0
    return summary, len(forwards) // policy_forwards, copied


@pytest.mark.parametrize(
    "overrides, before",
    [
        ({"loss_type": "sigmoid"}, math.log(2)),  # the policy is its reference: d = 0
        ({"loss_type": "ipo"}, 1 / (4 * 0.1**2)),  # (d - 1 / (2 beta))^2
        ({"loss_type": "hinge"}, 1.0),
        ({"loss_type": "robust", "label_smoothing": 0.1}, math.log(2)),
        ({"loss_type": "sigmoid", "rpo_alpha": 1.0}, None),  # log 2 plus the chosen responses' NLL
    ],
    ids=["sigmoid", "ipo", "hinge", "robust", "sigmoid-rpo"],
)
def test_reference_losses_start_from_their_known_value(tmp_path, overrides, before):
    summary, forwards, copied = _run_in_process(tmp_path, "run", **overrides)
    assert summary["reference"] == "copy" and copied == ["LlamaForCausalLM"] and forwards == 2  # policy, reference
    start = summary["eval_before_training"]["eval_loss"]
    if before is None:
        assert start > math.log(2) + 1.0  # the NLL of an untrained model is several nats per token
    else:
        assert start == pytest.approx(before, rel=1e-6)
    assert summary["eval_before_training"]["eval_rewards/margin"] == pytest.approx(0, abs=1e-6)


@pytest.mark.parametrize("loss_type, use_peft", [("simpo", False), ("orpo", False), ("simpo", True)])
def test_simpo_and_orpo_build_and_run_no_reference(tmp_path, loss_type, use_peft):
    summary, forwards, copied = _run_in_process(tmp_path, "run", loss_type=loss_type, use_peft=use_peft)
    assert summary["reference"] == "none"
    assert forwards == 1  # the policy's only: no reference model, no adapters-off pass
    assert copied == ([] if not use_peft else ["LlamaForCausalLM"])  # no frozen copy; LoRA's export copies once
    before = summary["eval_before_training"]
    assert before["eval_rewards/chosen"] < 0 and before["eval_rewards/margin"] != 0  # beta x mean log-prob
    assert loss_type != "orpo" or before["eval_loss"] > 1.0  # the chosen NLL is in the loss


def test_orpo_normalisation_is_exact_across_micro_batches(tmp_path):
    """orpo's per-token means and chosen NLL stay a mean over the step's pairs: 2 micro-batches of 2 pairs train as
    one batch of 4 (same pairs, same order; only the padding differs)."""
    from safetensors.torch import load_file

    one, _, _ = _run_in_process(tmp_path, "one", loss_type="orpo", eval_on_start=False)
    two, _, _ = _run_in_process(tmp_path, "two", loss_type="orpo", eval_on_start=False, per_device_train_batch_size=2,
                     gradient_accumulation_steps=2)  # fmt: skip
    records = [(tmp_path / run / "metrics.jsonl").read_text().splitlines() for run in ("one", "two")]
    losses = [[r["loss"] for r in map(json.loads, lines) if "loss" in r] for lines in records]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert one["eval"]["eval_loss"] == pytest.approx(two["eval"]["eval_loss"], rel=1e-5)
