"""Sampler-vs-trainer correction (`tunebook.rl.mismatch`) against TRL's formula written out token by token, the
mismatch figures, and what a checkpoint keeps of generation in flight."""

from __future__ import annotations

import math
from concurrent.futures import Future

import pytest
import torch

from tunebook.rl.generation import Generated
from tunebook.rl.mismatch import importance_weights
from tunebook.rl.rollouts import PendingRollouts, _Sampled
from tunebook.rl.stats import GRPOStats

TRAINER = [-1.0, -0.5, -2.0, -0.1, -3.0, -0.7]
SAMPLER = [-1.2, -0.4, -0.5, -0.1, -3.9, -0.6]
ROWS = [0, 0, 0, 1, 1, 2]  # three completions of 3, 2 and 1 tokens


def _trl(mode: str, low, high) -> list[float]:
    """trl/trainer/grpo_trainer.py's vllm_importance_sampling_ratio, with plain floats."""
    deltas = [t - s for t, s in zip(TRAINER, SAMPLER)]
    if mode.startswith("sequence"):
        per_row = [sum(d for d, r in zip(deltas, ROWS) if r == row) for row in range(3)]
        deltas = [per_row[r] for r in ROWS]
    ratios = [math.exp(d) for d in deltas]
    lo = -math.inf if low is None else low
    hi = math.inf if high is None else high
    if mode.endswith("truncate"):
        return [min(max(x, lo), hi) for x in ratios]
    return [0.0 if (x < lo or x > hi) else x for x in ratios]


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 2.0), (None, None)])
def test_importance_weights_are_trls_formula(mode, bounds):
    got = importance_weights(torch.tensor(TRAINER, requires_grad=True), torch.tensor(SAMPLER), torch.tensor(ROWS), 3,
                             mode, *bounds)  # fmt: skip
    assert not got.requires_grad  # a weight, not a path for gradients
    torch.testing.assert_close(got, torch.tensor(_trl(mode, *bounds)), atol=1e-6, rtol=1e-6)  # float32 exp


def test_the_weights_scale_the_surrogate_not_the_kl():
    from tunebook.rl.grpo import grpo_token_losses

    logp = torch.tensor([-1.0, -0.5]), torch.tensor([-1.1, -0.4])
    adv, ref, w = torch.tensor([1.0, -1.0]), torch.tensor([-1.3, -0.2]), torch.tensor([0.5, 2.0])
    plain, _, kl = grpo_token_losses(*logp, adv, 0.2, 0.2, beta=0.1, ref_log_probs=ref)
    weighted, _, _ = grpo_token_losses(*logp, adv, 0.2, 0.2, beta=0.1, ref_log_probs=ref, importance_weights=w)
    torch.testing.assert_close(weighted, (plain - 0.1 * kl) * w + 0.1 * kl)


class _OneProcess:
    num_processes = 1

    def gather(self, t):
        return t


def test_the_mismatch_figures():
    stats = GRPOStats("cpu", ["r"])
    stats.add(steps=1, loss=0.0, completions=3, trained_tokens=6)
    trainer, sampler = torch.tensor(TRAINER), torch.tensor(SAMPLER)
    weights = importance_weights(trainer, sampler, torch.tensor(ROWS), 3, "token_truncate", None, 2.0)
    stats.add_mismatch(trainer, sampler, weights)
    out = stats.pop(_OneProcess())
    deltas = [t - s for t, s in zip(TRAINER, SAMPLER)]
    assert out["sampling/sampling_logp_difference/mean"] == pytest.approx(sum(map(abs, deltas)) / 6, rel=1e-6)
    assert out["sampling/sampling_logp_difference/max"] == pytest.approx(1.5, rel=1e-6)
    k3 = sum(math.exp(d) - d - 1 for d in deltas) / 6  # KL(sampler || trainer), estimated on the sampler's tokens
    assert out["sampling/kl"] == pytest.approx(k3, rel=1e-5)
    assert out["sampling/importance_sampling_ratio/max"] == pytest.approx(2.0)  # exp(0.9) truncated at 2
    assert out["sampling/importance_sampling_ratio/min"] == pytest.approx(math.exp(-1.5), rel=1e-5)
    mean = (sum(min(math.exp(d), 2.0) for d in deltas)) / 6
    assert out["sampling/importance_sampling_ratio/mean"] == pytest.approx(mean, rel=1e-5)
    assert stats.pop(_OneProcess()) == {"loss": None}  # the window starts again empty
    stats.add(steps=1, loss=0.0, completions=1, trained_tokens=1)
    assert "sampling/kl" not in stats.pop(_OneProcess())  # no sampler log-probs, no figures


def test_a_checkpoint_keeps_the_completions_generated_ahead():
    pending = PendingRollouts()
    future = Future()
    future.set_result([_Sampled(Generated([[5, 1], [7]], [[-0.5, -0.1], [-2.0]]), 1.5)])
    pending.ahead = future
    state = pending.state_dict()  # waits for the generation in flight
    assert state == {"ahead": [[[[[5, 1], [7]], [[-0.5, -0.1], [-2.0]]], 1.5, None]]}
    resumed = PendingRollouts()
    resumed.load_state_dict(state)
    assert resumed.take("cpu") is None and resumed.ahead == state["ahead"]
    assert resumed.state_dict() == state  # saved again before it was used: the same
    assert PendingRollouts().state_dict() is None


def test_an_older_checkpoints_figures_load():
    stats = GRPOStats("cpu", ["a", "b"])
    old = [float(i) for i in range(14 + 6)]  # the 14 figures before the sampling ones, then 3 per reward
    stats.load_state_dict({"sums": old})
    assert stats.sums[:14].tolist() == old[:14] and stats.sums[-6:].tolist() == old[14:]
