"""The generation backend interface (`tunebook.rl.generation`) with the transformers backend: what it samples and
the log-probs it reports against the trainer's own computation."""

from __future__ import annotations

import pytest
import torch
from test_grpo_loss import _policy, _rollouts, _tolerance

from tunebook.rl.generation import Sampling, TransformersBackend
from tunebook.rl.grpo import completion_log_probs, sample_completions


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_reported_log_probs_are_the_trainers_log_probs_of_the_sampled_tokens(temperature):
    """The backend's log-probs (recorded during `generate`, KV cache and left padding) equal the trainer's
    recomputation (`completion_log_probs`, one forward of prompt + completion) token for token, float32."""
    model = _policy("linear")
    prompt_ids = [[5, 9, 11, 3], [7, 2], [4, 4, 8]] * 2
    backend = TransformersBackend(model, "cpu")
    sampling = Sampling(max_new_tokens=6, temperature=temperature, stop_token_ids=(1,), pad_token_id=0)
    out = backend.generate(prompt_ids, list(range(6)), sampling)
    assert [len(c) for c in out.token_ids] == [len(lp) for lp in out.log_probs]
    assert out.token_ids == sample_completions(model, prompt_ids, list(range(6)), pad_token_id=0, eos_token_id=[1],
                                               max_new_tokens=6, temperature=temperature, top_p=1.0, device="cpu")  # fmt: skip
    with torch.no_grad():
        trainer, _ = completion_log_probs(model, _rollouts(prompt_ids, out.token_ids), temperature)
    reported = torch.tensor([x for row in out.log_probs for x in row])
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids[0]])).logits
    torch.testing.assert_close(reported, trainer, atol=_tolerance(logits, temperature, 64) * 10, rtol=0)
    # and not at any temperature: untempered log-probs differ
    with torch.no_grad():
        plain, _ = completion_log_probs(model, _rollouts(prompt_ids, out.token_ids), 1.0)
    assert (plain - reported).abs().max() > 1e-3


def test_a_snapshot_samples_the_pushed_weights_not_the_live_ones():
    """async generation samples from a copy: training the policy leaves it alone until `push_weights`."""
    model = _policy("linear")
    backend = TransformersBackend(model, "cpu", snapshot=True)
    prompt_ids, seeds = [[5, 9, 11, 3]] * 4, [0, 1, 2, 3]
    sampling = Sampling(max_new_tokens=5, temperature=1.0, stop_token_ids=(1,), pad_token_id=0)
    before = backend.generate(prompt_ids, seeds, sampling)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)  # "training"
    assert backend.generate(prompt_ids, seeds, sampling).log_probs == before.log_probs
    backend.push_weights(model)
    after = backend.generate(prompt_ids, seeds, sampling)
    live = TransformersBackend(model, "cpu").generate(prompt_ids, seeds, sampling)
    assert after.token_ids == live.token_ids  # the same weights (a copy's kernels may round the last bit apart)
    torch.testing.assert_close(torch.tensor(after.log_probs), torch.tensor(live.log_probs), atol=1e-5, rtol=0)
    assert after.log_probs != before.log_probs
