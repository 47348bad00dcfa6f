from __future__ import annotations

import numpy as np

from tunebook.data.loaders import LengthGroupedSampler, build_loader


def _lengths(n=1000, seed=0):
    return np.random.default_rng(seed).integers(5, 500, size=n)


def test_length_grouped_batches_pad_far_less_than_random_ones():
    lengths = _lengths()
    order = list(LengthGroupedSampler(lengths, batch_size=8, seed=1))
    assert sorted(order) == list(range(len(lengths)))

    def padded(order):
        batches = [lengths[order[i : i + 8]] for i in range(0, len(order), 8)]
        return sum(len(b) * b.max() for b in batches)

    random_order = np.random.default_rng(1).permutation(len(lengths)).tolist()
    assert padded(order) < 0.7 * padded(random_order)
    assert lengths[order[:8]].max() == lengths.max()  # the longest batch first: out-of-memory shows at step 1


def test_order_depends_only_on_seed_and_epoch():
    lengths = _lengths()
    a, b = LengthGroupedSampler(lengths, 8, seed=1), LengthGroupedSampler(lengths, 8, seed=1)
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b)
    assert list(LengthGroupedSampler(lengths, 8, seed=2)) != list(a)


def test_loader_uses_the_length_grouped_sampler_only_when_shuffling_with_lengths():
    data = [{"x": i} for i in range(10)]
    loader = build_loader(data, 2, lambda b: b, shuffle=True, seed=0, lengths=np.arange(10), group_size=4)
    assert isinstance(loader.sampler, LengthGroupedSampler) and loader.sampler.batch_size == 4
    assert not isinstance(build_loader(data, 2, lambda b: b, shuffle=True, seed=0).sampler, LengthGroupedSampler)
