"""recipes/dpo.py with each loss_type: a short in-process run each, the reference-based losses' known value before
training, and no reference model (no copy, no adapters-off pass) for simpo and orpo."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from support import TINY_TEST_MODEL
from transformers import PreTrainedModel

import tunebook.preference.losses as preference
from tunebook import load_recipe

pytestmark = pytest.mark.slow
QUICK = {"disable_tqdm": True, "report_to": "none", "dataloader_num_workers": 0, "log_level": "WARNING",
         "model_config": TINY_TEST_MODEL, "synthetic_train_size": 64, "synthetic_eval_size": 8, "sft_warmup_steps": 0,
         "max_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 4, "per_device_eval_batch_size": 8,
         "save_strategy": "no"}  # fmt: skip


def _run(tmp_path, name, **overrides):
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
    summary, forwards, copied = _run(tmp_path, "run", **overrides)
    assert summary["reference"] == "copy" and copied == ["LlamaForCausalLM"] and forwards == 2  # policy, reference
    start = summary["eval_before_training"]["eval_loss"]
    if before is None:
        assert start > math.log(2) + 1.0  # the NLL of an untrained model is several nats per token
    else:
        assert start == pytest.approx(before, rel=1e-6)
    assert summary["eval_before_training"]["eval_rewards/margin"] == pytest.approx(0, abs=1e-6)


@pytest.mark.parametrize("loss_type, use_peft", [("simpo", False), ("orpo", False), ("simpo", True)])
def test_simpo_and_orpo_build_and_run_no_reference(tmp_path, loss_type, use_peft):
    summary, forwards, copied = _run(tmp_path, "run", loss_type=loss_type, use_peft=use_peft)
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

    one, _, _ = _run(tmp_path, "one", loss_type="orpo", eval_on_start=False)
    two, _, _ = _run(tmp_path, "two", loss_type="orpo", eval_on_start=False, per_device_train_batch_size=2,
                     gradient_accumulation_steps=2)  # fmt: skip
    records = [(tmp_path / run / "metrics.jsonl").read_text().splitlines() for run in ("one", "two")]
    losses = [[r["loss"] for r in map(json.loads, lines) if "loss" in r] for lines in records]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert one["eval"]["eval_loss"] == pytest.approx(two["eval"]["eval_loss"], rel=1e-5)
