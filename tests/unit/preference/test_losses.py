"""Every preference loss against a direct computation of its formula: the per-pair losses, the rewards, and the
gradient (central differences of the same formula in plain Python floats); the config's checks of the loss keys; and DPO end to end on two tiny models, its log-probabilities taken from the
full logits."""

from __future__ import annotations

import math
import typing

import pytest
import torch
from accelerate import Accelerator

from tunebook.config import DPOConfig
from tunebook.data.collate import PairCollator
from tunebook.errors import ConfigError
from tunebook.models import build_causal_lm
from tunebook.preference import (
    LOSS_TYPES,
    REFERENCE_FREE_LOSSES,
    RewardStats,
    dpo_loss,
    policy_and_reference_log_probs,
    preference_loss,
    response_lengths,
    sequence_log_probs,
)
from tunebook.preference.data import tokenize_pairs

BETA, EPS, GAMMA, ALPHA = 0.3, 0.2, 0.5, 0.7
# Three pairs, rows chosen then rejected: summed log-probabilities and response lengths. The mean log-probabilities
# per token fall on both sides of -log 2 (orpo's log(1 - e^a) switches formula there), and hinge's pairs sit on
# both sides of its kink.
POLICY = [-2.1, -9.0, -1.2, -4.4, -6.5, -7.5]
REFERENCE = [-2.5, -12.0, -1.9, -4.0, -6.0, -7.0]
LENGTHS = [3, 5, 4, 6, 2, 7]


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _direct(loss_type: str, p: list[float], rpo_alpha: float | None = None) -> list[float]:
    """Each pair's loss, written from the papers' formulas (TRL's forms) with nothing shared with the library."""
    out = []
    for i in range(3):
        pc, pr, rc, rr = p[i], p[i + 3], REFERENCE[i], REFERENCE[i + 3]
        nc, nr = LENGTHS[i], LENGTHS[i + 3]
        d = (pc - rc) - (pr - rr)  # the log-ratio difference
        ac, ar = pc / nc, pr / nr  # mean log-probability per token
        if loss_type == "sigmoid":
            loss = -(1 - EPS) * _log_sigmoid(BETA * d) - EPS * _log_sigmoid(-BETA * d)
        elif loss_type == "ipo":
            loss = ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * BETA)) ** 2
        elif loss_type == "hinge":
            loss = max(0.0, 1 - BETA * d)
        elif loss_type == "robust":
            loss = (-(1 - EPS) * _log_sigmoid(BETA * d) + EPS * _log_sigmoid(-BETA * d)) / (1 - 2 * EPS)
        elif loss_type == "simpo":
            loss = -_log_sigmoid(BETA * (ac - ar) - GAMMA)
        else:  # orpo: the chosen NLL per token, minus beta log sigmoid of the log odds ratio
            odds = lambda a: math.exp(a) / (1 - math.exp(a))  # noqa: E731
            loss = -ac - BETA * _log_sigmoid(math.log(odds(ac)) - math.log(odds(ar)))
        if rpo_alpha is not None:
            loss += rpo_alpha * -ac
        out.append(loss)
    return out


def _library(loss_type: str, rpo_alpha: float | None = None):
    policy = torch.tensor(POLICY, dtype=torch.float64, requires_grad=True)
    reference = None if loss_type in REFERENCE_FREE_LOSSES else torch.tensor(REFERENCE, dtype=torch.float64)
    eps = EPS if loss_type in ("sigmoid", "robust") else 0.0
    losses, chosen, rejected = preference_loss(
        policy, reference, torch.tensor(LENGTHS), loss_type, BETA, eps, GAMMA, rpo_alpha
    )
    (grad,) = torch.autograd.grad(losses.sum(), policy)
    return losses, chosen, rejected, grad


@pytest.mark.parametrize(
    "loss_type, rpo_alpha", [(t, None) for t in LOSS_TYPES] + [("sigmoid", ALPHA), ("ipo", ALPHA), ("simpo", ALPHA)]
)
def test_each_loss_and_its_gradient_equal_the_formula(loss_type, rpo_alpha):
    losses, chosen, rejected, grad = _library(loss_type, rpo_alpha)
    assert losses.tolist() == pytest.approx(_direct(loss_type, POLICY, rpo_alpha), rel=1e-12, abs=1e-12)
    h = 1e-6
    for j in range(len(POLICY)):
        up, down = list(POLICY), list(POLICY)
        up[j] += h
        down[j] -= h
        numeric = (sum(_direct(loss_type, up, rpo_alpha)) - sum(_direct(loss_type, down, rpo_alpha))) / (2 * h)
        assert grad[j].item() == pytest.approx(numeric, abs=1e-7), (loss_type, j)
    # Rewards: beta x the log-ratio with a reference, beta x the mean log-probability per token without.
    if loss_type in REFERENCE_FREE_LOSSES:
        expected = [BETA * p / n for p, n in zip(POLICY, LENGTHS)]
    else:
        expected = [BETA * (p - r) for p, r in zip(POLICY, REFERENCE)]
    assert [*chosen.tolist(), *rejected.tolist()] == pytest.approx(expected, rel=1e-12)
    assert not chosen.requires_grad and not rejected.requires_grad


def test_the_cases_the_formulas_are_known_for():
    # The policy as its own reference: sigmoid and robust give log 2 at any smoothing, hinge 1, ipo 1/(4 beta^2).
    same = torch.tensor(REFERENCE, dtype=torch.float64)
    lengths = torch.tensor(LENGTHS)
    for loss_type, value in (("sigmoid", math.log(2)), ("robust", math.log(2)), ("hinge", 1.0)):
        assert preference_loss(same, same, lengths, loss_type, BETA, EPS)[0].tolist() == pytest.approx([value] * 3)
    assert preference_loss(same, same, lengths, "ipo", BETA)[0].tolist() == pytest.approx([1 / (4 * BETA**2)] * 3)
    # The sigmoid loss is dpo_loss, and an unknown loss_type names the choices.
    moved = torch.cat([same[:3] + 1, same[3:]])
    by_dpo_loss = dpo_loss(moved[:3], moved[3:], same[:3], same[3:], BETA, EPS)
    by_type = preference_loss(moved, same, lengths, "sigmoid", BETA, EPS)
    assert all(torch.equal(x, y) for x, y in zip(by_dpo_loss, by_type))
    with pytest.raises(ValueError, match="choose one of sigmoid, ipo, hinge, robust, simpo, orpo"):
        preference_loss(same, same, lengths, "kto")
    # orpo stays finite with its gradient as a response's mean log-probability nears 0 (e^a -> 1).
    near_zero = torch.tensor([-1e-4, -30.0], dtype=torch.float64, requires_grad=True)
    loss = preference_loss(near_zero, None, torch.tensor([1, 1]), "orpo", BETA)[0]
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(near_zero.grad).all()


def test_mean_log_probs_count_the_tokens_sequence_log_probs_sums(tiny_tokenizer, tiny_model_config):
    pairs = {"prompt": ["Reverse the digits.\n1234", "Sort the digits.\n391"], "chosen": ["4321", "139"],
             "rejected": ["1234 and more", "193"]}  # fmt: skip
    tokenized = tokenize_pairs(pairs, [0, 1], tokenizer=tiny_tokenizer, max_seq_length=64, overlong="truncate",
                               where="test")  # fmt: skip
    batch = PairCollator(tiny_tokenizer.pad_token_id, 8)([{k: tokenized[k][i] for k in tokenized} for i in range(2)])
    labels = tokenized["chosen_labels"] + tokenized["rejected_labels"]
    assert response_lengths(batch["labels"]).tolist() == [sum(t != -100 for t in row[1:]) for row in labels]
    torch.manual_seed(0)
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config).eval()
    # A reference-free loss runs no reference: with no reference model and no adapters there is none to run.
    policy, reference = policy_and_reference_log_probs(model, None, batch, "sdpa", torch.float32, Accelerator(cpu=True),
                                                       use_reference=False)  # fmt: skip
    assert reference is None and policy.shape == (4,)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"loss_type": "kto"}, "loss_type.*'sigmoid', 'ipo', 'hinge', 'robust', 'simpo', 'orpo'"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing applies to loss_type sigmoid or robust only"),
        (
            {"loss_type": "robust", "label_smoothing": 0.5},
            r"config key .label_smoothing. must be in \[0, 0.5\), got 0.5",
        ),
        ({"loss_type": "orpo", "rpo_alpha": 1.0}, "rpo_alpha does not apply to loss_type orpo"),
        ({"rpo_alpha": -1.0}, "config key .rpo_alpha. must be >= 0, got -1.0"),
        ({"loss_type": "simpo", "precompute_ref_log_probs": True}, "loss_type simpo has none"),
        ({"loss_type": "orpo", "precompute_ref_log_probs": True}, "loss_type orpo has none"),
    ],
)
def test_loss_keys_are_checked_in_one_line(overrides, message):
    from tunebook.config import parse_config

    with pytest.raises(ConfigError, match=message) as error:
        parse_config(DPOConfig, None, overrides, "test")
    assert "\n" not in str(error.value)


def test_the_config_offers_exactly_the_library_losses():
    choices = typing.get_args(typing.get_type_hints(DPOConfig)["loss_type"])
    assert choices == LOSS_TYPES
    config = DPOConfig(loss_type="robust", label_smoothing=0.2, rpo_alpha=1.0)
    assert (config.loss_type, config.simpo_gamma, config.rpo_alpha) == ("robust", 0.5, 1.0)


# DPO end to end on two tiny models: the log-probabilities from the full logits, then the formula.
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
