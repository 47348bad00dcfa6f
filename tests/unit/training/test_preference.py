"""DPO against a direct computation of its formula from full logits of two tiny models."""

from __future__ import annotations

import math

import pytest
import torch
from accelerate import Accelerator

from tunebook.data.collate import PairCollator
from tunebook.models import build_causal_lm
from tunebook.preference import RewardStats, dpo_loss, policy_and_reference_log_probs, sequence_log_probs
from tunebook.preference.data import make_preference, tokenize_pairs

PAIRS = {
    "prompt": ["Reverse the digits.\n1234", [{"role": "user", "content": "Sort the digits in ascending order.\n391"}]],
    "chosen": ["4321", [{"role": "assistant", "content": "139"}]],
    "rejected": ["1234", "193"],
}


def _direct_log_prob(model, input_ids, labels) -> float:
    """log p(response | prompt) from the full logits: sum over labelled positions of log softmax at the target."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([input_ids])).logits[0].double()
    total = 0.0
    for t in range(1, len(input_ids)):
        if labels[t] != -100:
            total += torch.log_softmax(logits[t - 1], -1)[labels[t]].item()
    return total


def test_dpo_loss_equals_the_formula_on_a_tiny_model(tiny_tokenizer, tiny_model_config):
    tokenized = tokenize_pairs(PAIRS, [0, 1], tokenizer=tiny_tokenizer, max_seq_length=64, overlong="truncate",
                               where="test")  # fmt: skip
    assert tokenized["keep"] == [True, True] and tokenized["truncated"] == [False, False]
    for ids, labels in zip(tokenized["chosen_input_ids"], tokenized["chosen_labels"]):
        response = [t for t in labels if t != -100]
        assert (
            response
            and ids[-len(response) :] == response
            and labels[: len(ids) - len(response)] == [-100] * (len(ids) - len(response))
        )  # only the response carries labels
    torch.manual_seed(0)
    policy = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config).eval()
    torch.manual_seed(1)
    reference = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config).eval()
    features = [{k: tokenized[k][i] for k in tokenized} for i in range(2)]
    batch = PairCollator(tiny_tokenizer.pad_token_id, 8)(features)
    assert batch["input_ids"].shape[0] == 4  # chosen, chosen, rejected, rejected

    beta, smoothing = 0.3, 0.1
    accelerator = Accelerator(cpu=True)
    pi, ref = policy_and_reference_log_probs(policy, reference, batch, "sdpa", torch.float32, accelerator)
    losses, chosen_rewards, rejected_rewards = dpo_loss(pi[:2], pi[2:], ref[:2], ref[2:], beta, smoothing)
    for i in range(2):
        direct = {}
        for side in ("chosen", "rejected"):
            ids, labels = tokenized[f"{side}_input_ids"][i], tokenized[f"{side}_labels"][i]
            direct[side] = (_direct_log_prob(policy, ids, labels), _direct_log_prob(reference, ids, labels))
        r_c = beta * (direct["chosen"][0] - direct["chosen"][1])
        r_r = beta * (direct["rejected"][0] - direct["rejected"][1])
        sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
        expected = -(1 - smoothing) * math.log(sigmoid(r_c - r_r)) - smoothing * math.log(sigmoid(r_r - r_c))
        assert losses[i].item() == pytest.approx(expected, abs=1e-5)
        assert chosen_rewards[i].item() == pytest.approx(r_c, abs=1e-5)
        assert rejected_rewards[i].item() == pytest.approx(r_r, abs=1e-5)
    assert sequence_log_probs(policy, batch)[0].item() == pytest.approx(
        _direct_log_prob(policy, tokenized["chosen_input_ids"][0], tokenized["chosen_labels"][0]), abs=1e-5
    )

    stats = RewardStats("cpu")
    stats.add(losses, chosen_rewards, rejected_rewards)
    window = stats.pop(accelerator)
    assert window["loss"] == pytest.approx(losses.mean().item())
    assert window["rewards/accuracy"] == (chosen_rewards > rejected_rewards).float().mean().item()
    assert window["rewards/margin"] == pytest.approx((chosen_rewards - rejected_rewards).mean().item())

    # With the policy as its own reference, every reward is 0 and the loss is log 2.
    pi, ref = policy_and_reference_log_probs(policy, policy, batch, "sdpa", torch.float32, accelerator)
    assert dpo_loss(pi[:2], pi[2:], ref[:2], ref[2:], beta)[0].tolist() == pytest.approx([math.log(2)] * 2)


def test_overlong_pairs_are_cut_or_dropped_and_synthetic_pairs_differ(tiny_tokenizer):
    full = tokenize_pairs(PAIRS, [0, 1], tokenizer=tiny_tokenizer, max_seq_length=1000, overlong="drop", where="t")
    prompt_lengths = [labels.count(-100) for labels in full["chosen_labels"]]
    limit = max(prompt_lengths) + 1  # both prompts fit, not every response
    args = {"tokenizer": tiny_tokenizer, "max_seq_length": limit, "where": "test"}
    cut = tokenize_pairs(PAIRS, [0, 1], overlong="truncate", **args)
    dropped = tokenize_pairs(PAIRS, [0, 1], overlong="drop", **args)
    assert cut["keep"] == [True, True] and any(cut["truncated"])
    assert all(len(ids) <= limit for ids in cut["chosen_input_ids"] + cut["rejected_input_ids"])
    assert cut["chosen_labels"][0][: prompt_lengths[0]] == [-100] * prompt_lengths[0]  # the prompt kept whole
    assert dropped["keep"] == [not t for t in cut["truncated"]]
    too_short = tokenize_pairs(PAIRS, [0, 1], overlong="truncate", **{**args, "max_seq_length": min(prompt_lengths)})
    assert too_short["keep"] == [False, False]  # no room for any response: dropped even when truncating
    import random

    rng = random.Random(0)
    for _ in range(50):
        pair = make_preference(rng)
        assert pair["chosen"] != pair["rejected"] and len(pair["chosen"]) == len(pair["rejected"])
