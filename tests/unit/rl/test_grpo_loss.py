"""GRPO's pieces against direct computations: the clipped loss of each loss_type over micro-batches, advantages,
the seeded sampler, the tempered log-probs, and the reward functions' contract."""

from __future__ import annotations

import math

import pytest
import torch
from rl_policies import policy as _policy
from rl_policies import rollouts as _rollouts
from rl_policies import tolerance as _tolerance

from tunebook.errors import ConfigError
from tunebook.rl.grpo import (
    SeededSampling,
    completion_log_probs,
    group_advantages,
    grpo_token_losses,
    loss_normaliser,
    loss_numerator,
    sample_completions,
)
from tunebook.rl.rewards import RewardFunction, combined, exact_match, format_regex, length_penalty, score


def _direct_token_loss(logp, old, adv, eps, eps_high, beta=0.0, ref=None):
    ratio = math.exp(logp - old)
    loss = -min(ratio * adv, min(max(ratio, 1 - eps), 1 + eps_high) * adv)
    if beta:
        loss += beta * (math.exp(ref - logp) - (ref - logp) - 1)
    return loss


def test_token_losses_equal_the_formula_with_both_clips_and_the_kl():
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.1, -3.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.0, -0.9, -1.5, -0.5, -2.9], dtype=torch.float64)
    adv = torch.tensor([1.0, 2.0, -1.0, -0.5, 0.7], dtype=torch.float64)
    ref = torch.tensor([-1.2, -0.4, -2.5, -0.2, -3.1], dtype=torch.float64)
    losses, clipped, kl = grpo_token_losses(logp, old, adv, 0.2, 0.28, beta=0.04, ref_log_probs=ref)
    expected = [
        _direct_token_loss(*map(float, v), 0.2, 0.28, 0.04, float(r))
        for v, r in zip(zip(logp.detach(), old, adv), ref)
    ]
    assert losses.tolist() == pytest.approx(expected, abs=1e-12)
    ratio = torch.exp(logp - old).detach()
    # Clipped where the ratio left its range in the direction the advantage rewards.
    assert clipped.tolist() == [False, True, True, False, False]
    assert ratio[1] > 1.28 and ratio[2] < 0.8  # a ratio above 1 + eps_high with A > 0, below 1 - eps with A < 0
    assert ratio[3] > 1.2  # above the range but A < 0: the unclipped term is the smaller, so not clipped
    losses.sum().backward()
    # A clipped token passes no gradient through the surrogate; the KL term still does.
    grad_kl = 0.04 * (1 - torch.exp(ref - logp.detach()))
    assert logp.grad[1].item() == pytest.approx(grad_kl[1].item(), abs=1e-12)
    assert logp.grad[0].item() == pytest.approx((-adv[0] * ratio[0] + grad_kl[0]).item(), abs=1e-12)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_each_loss_type_over_micro_batches_equals_its_formula_on_the_whole_step(loss_type):
    """Two micro-batches with step-wide denominators sum to the loss of the step computed at once."""
    torch.manual_seed(0)
    lengths = torch.tensor([3, 1, 5, 2, 4, 2])
    token = [torch.randn(int(n), dtype=torch.float64) for n in lengths]  # per-token losses of 6 completions
    max_new = 8
    if loss_type == "grpo":
        expected = sum(t.mean() for t in token) / len(token)
    elif loss_type == "dapo":
        expected = torch.cat(token).sum() / lengths.sum()
    else:
        expected = torch.cat(token).sum() / (len(token) * max_new)
    normaliser = loss_normaliser(loss_type, torch.tensor(6.0), lengths.sum().double(), max_new)
    total = 0.0
    for part in (slice(0, 2), slice(2, 6)):  # micro-batches of 2 and 4 completions
        part_lengths = lengths[part]
        rows = torch.repeat_interleave(torch.arange(len(part_lengths)), part_lengths)
        total += loss_numerator(torch.cat(token[part]), rows, part_lengths, loss_type) / normaliser
    assert float(total) == pytest.approx(float(expected), abs=1e-12)


def test_advantages_by_group_batch_and_none():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0])
    adv, zero = group_advantages(rewards, 4, "none")
    assert adv.tolist() == pytest.approx(centred.tolist()) and zero.tolist() == [False, True]
    adv, _ = group_advantages(rewards, 4, "group")
    assert adv[:4].tolist() == pytest.approx((centred[:4] / (torch.tensor([1.0, 0, 0, 0]).std() + 1e-4)).tolist())
    assert adv[4:].tolist() == [0.0] * 4
    adv, _ = group_advantages(rewards, 4, "batch", batch_std=torch.tensor(2.0))
    assert adv.tolist() == pytest.approx((centred / (2.0 + 1e-4)).tolist())


def test_frac_reward_zero_std_counts_constant_groups_under_batch_scaling_too():
    """By design, as the README says: under scale_rewards batch TRL logs whether the whole batch's rewards are equal
    (here: no, 0.0); Tunebook the share of groups whose rewards are (here 1 of 2), which teach nothing either way."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    _, zero = group_advantages(rewards, 4, "batch", batch_std=rewards.std())
    assert rewards.std() > 0 and zero.tolist() == [False, True]


def test_seeded_sampling_draws_from_the_tempered_distribution_and_respects_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    draws = SeededSampling(list(range(4000)), temperature=2.0, top_p=1.0)(None, logits).argmax(dim=-1)
    frequencies = torch.bincount(draws, minlength=4).float() / 4000
    assert frequencies.tolist() == pytest.approx(torch.softmax(logits[0] / 2.0, -1).tolist(), abs=0.025)
    # top_p 0.7 of softmax([2, 1, 0, -1]) = [0.64, 0.24, 0.09, 0.03]: the two most likely tokens only.
    draws = SeededSampling(list(range(4000)), temperature=1.0, top_p=0.7)(None, logits).argmax(dim=-1)
    assert set(draws.tolist()) == {0, 1}
    # One row's draws depend on its seed only, not on the other rows beside it.
    alone = SeededSampling([7], 1.0, 1.0)(None, logits[:1]).argmax(-1)
    among = SeededSampling([3, 7, 11], 1.0, 1.0)(None, logits[:3]).argmax(-1)
    assert alone.item() == among[1].item()


def test_built_in_rewards():
    assert exact_match(None, [" 123 ", "12"], reference=["123", "123"]) == [1.0, 0.0]
    assert format_regex(None, ["<a>1</a>", "x<a>1</a>"], pattern=r"<a>\d+</a>") == [1.0, 0.0]
    assert length_penalty(None, ["", "", ""], completion_lengths=[4, 10, 16], max_new_tokens=16, buffer=8) == [
        0.0,
        -0.25,
        -1.0,
    ]


def test_rewards_are_weighted_and_a_none_adds_nothing():
    functions = [
        RewardFunction("a", lambda p, c, **k: [1.0, None], 2.0),
        RewardFunction("b", lambda p, c, **k: [0.5, 1], 1.0),
    ]
    rewards = score(functions, ["p", "q"], ["x", "y"], {}, "cpu")
    assert torch.isnan(rewards[1, 0]) and combined(rewards, functions).tolist() == [2.5, 1.0]


@pytest.mark.parametrize(
    "fn, message",
    [
        (lambda p, c, **k: 1 / 0, r"reward function 'bad' raised ZeroDivisionError: division by zero"),
        (lambda p, c, **k: [1.0], r"reward function 'bad' returned 1 values for 2 completions"),
        (lambda p, c, **k: [1.0, "x"], r"reward function 'bad' returned 'x' for completion 1"),
        (lambda p, c, **k: [1.0, float("nan")], r"reward function 'bad' returned nan for completion 1"),
    ],
)
def test_a_broken_reward_function_is_one_line_naming_it(fn, message):
    with pytest.raises(ConfigError, match=message):
        score([RewardFunction("bad", fn, 1.0)], ["p", "q"], ["x", "y"], {}, "cpu")


@pytest.mark.parametrize("head", ["linear", "bias", "unfused"])
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_completion_log_probs_are_the_log_softmax_of_the_tempered_logits(head, temperature, monkeypatch):
    """TRL's `_get_per_token_logps_and_entropies`: log_softmax(logits / T) at the completion tokens, for the policy,
    the old policy and the reference alike; fused into the output layer (with or without a bias) or not."""
    if head == "unfused":  # a head the fused loss does not take (LoRA on lm_head, quantized): logits, then the loss
        monkeypatch.setattr("tunebook.training.loss.fusable_output_layer", lambda model, positions: False)
    model = _policy(head)
    generator = torch.Generator().manual_seed(1)
    prompt_ids = [torch.randint(1, 64, (n,), generator=generator).tolist() for n in (5, 3, 7)]
    completions = [torch.randint(1, 64, (n,), generator=generator).tolist() for n in (4, 6, 2)]
    r = _rollouts(prompt_ids, completions)
    with torch.no_grad():
        log_probs, rows = completion_log_probs(model, r, temperature)
        logits = model(input_ids=r.input_ids, attention_mask=r.attention_mask).logits.float()
    expected, raw, expected_rows = [], [], []  # row by row, token by token: the loss-position order
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        for k, token in enumerate(c):
            at = logits[i, len(p) + k - 1]  # the logits that predict completion token k
            expected.append(torch.log_softmax(at / temperature, -1)[token])
            raw.append(torch.log_softmax(at, -1)[token])
            expected_rows.append(i)
    expected, raw = torch.stack(expected), torch.stack(raw)
    tolerance = _tolerance(logits, temperature, model.config.hidden_size)
    assert rows.tolist() == expected_rows
    torch.testing.assert_close(log_probs, expected, atol=tolerance, rtol=0)
    if temperature != 1.0:  # the raw logits' log-probs (before the fix) are far outside that tolerance
        assert (raw - expected).abs().max() > 1000 * tolerance


@pytest.mark.parametrize("temperature", [0.5, 1.6])
def test_the_loss_log_probs_are_those_of_the_policy_that_sampled(temperature, monkeypatch):
    """On-policy: where the sampling model is the policy, the first update's ratio pi / pi_sampling is 1 for every
    token: the loss's log-probs equal log_softmax(logits / T) of the very logits the sampler tempered and drew from
    (recorded as they reach it, from `generate` with its KV cache and left padding)."""
    seen = []
    sample = SeededSampling.__call__

    def recording(self, input_ids, scores):
        seen.append(scores.detach().float().clone())
        return sample(self, input_ids, scores)

    monkeypatch.setattr(SeededSampling, "__call__", recording)
    model = _policy("linear")
    prompt_ids = [[5, 9, 11, 3], [7, 2], [4, 4, 8]] * 2
    completions = sample_completions(model, prompt_ids, list(range(6)), pad_token_id=0, eos_token_id=1,
                                     max_new_tokens=6, temperature=temperature, top_p=1.0, device="cpu")  # fmt: skip
    sampling = torch.stack([
        torch.log_softmax(seen[k][i] / temperature, -1)[token] for i, c in enumerate(completions)
        for k, token in enumerate(c)
    ])  # fmt: skip
    with torch.no_grad():
        log_probs, _ = completion_log_probs(model, _rollouts(prompt_ids, completions), temperature)
        untempered, _ = completion_log_probs(model, _rollouts(prompt_ids, completions))
    ratio = torch.exp(log_probs - sampling)
    tolerance = _tolerance(torch.stack(seen), temperature, model.config.hidden_size)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=tolerance, rtol=0)
    assert (torch.exp(untempered - sampling) - 1).abs().max() > 1000 * tolerance  # what the loss used before
