"""Distillation's sampled completions: which steps are on-policy, the prompts cut from a batch, and the rows built
from a backend's completions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tunebook.data import PadCollator
from tunebook.distillation import batch_prompts, is_on_policy_step, sampled_batch
from tunebook.rl.generation import Generated, GenerationBackend, Sampling


@pytest.mark.parametrize("lmbda", [0.0, 0.3, 1.0])
def test_a_share_lmbda_of_the_steps_is_on_policy_decided_by_seed_and_step(lmbda):
    decisions = [is_on_policy_step(7, step, lmbda) for step in range(2000)]
    assert sum(decisions) / len(decisions) == pytest.approx(lmbda, abs=0.04)
    assert decisions == [is_on_policy_step(7, step, lmbda) for step in range(2000)]  # the same again (a resume)
    if 0 < lmbda < 1:
        assert decisions != [is_on_policy_step(8, step, lmbda) for step in range(2000)]
        assert 0 < sum(decisions[:20]) < 20  # consecutive steps are not correlated (integer seeds once were)


class _Echo(GenerationBackend):
    """Completes each prompt with its seed's last digit and token 2 (the stop token), and records what it was asked."""

    def generate(self, prompt_ids, seeds, sampling, images=None):
        self.asked = (prompt_ids, seeds, sampling)
        return Generated([[10 + seed % 10, 11, 2] for seed in seeds])


def test_sampled_completions_replace_the_datas_after_each_prompt():
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, -100, 8, 9]},
            {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}]  # fmt: skip
    batch = PadCollator(0)(rows)
    assert batch_prompts(batch) == [[5, 6, 7], [5]]
    backend = _Echo()
    sampling = Sampling(max_new_tokens=3, pad_token_id=0, stop_token_ids=(2,))
    config = SimpleNamespace(seed=1, max_seq_length=5, pad_to_multiple_of=None)
    out = sampled_batch(backend, batch, sampling, config, step=3, micro=0, process=0)
    prompts, seeds, asked = backend.asked
    assert prompts == [[5, 6, 7], [5]] and asked is sampling and len(set(seeds)) == 2
    first, second = 10 + seeds[0] % 10, 10 + seeds[1] % 10
    # The first row is cut at max_length (5 tokens); padding carries no label.
    assert out["input_ids"].tolist() == [[5, 6, 7, first, 11], [5, second, 11, 2, 0]]
    assert out["labels"].tolist() == [[-100, -100, -100, first, 11], [-100, second, 11, 2, -100]]
    assert out["loss_targets"].tolist() == [first, 11, second, 11, 2]
    # Another micro-batch, process or step samples with other seeds.
    for change in ({"micro": 1}, {"process": 1}, {"step": 4}):
        sampled_batch(backend, batch, sampling, config, **{"step": 3, "micro": 0, "process": 0, **change})
        assert not set(backend.asked[1]) & set(seeds)


def test_a_row_without_a_label_is_all_prompt_and_every_prompt_has_a_token():
    """Plain text (every token labelled) is prompted with its first token, which the loss never predicts."""
    rows = [{"input_ids": [4, 5, 6], "labels": [-100, -100, -100]}, {"input_ids": [4, 7], "labels": [4, 7]}]
    batch = PadCollator(0)(rows)
    assert batch_prompts(batch) == [[4, 5, 6], [4]]
