from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch

from tunebook.data.collate import PackedCollator
from tunebook.data.packing import (
    SEGMENT_SDPA,
    attention_inputs,
    best_fit_decreasing,
    example_lengths,
    pack_dataset,
    segment_sdpa_attention,
)
from tunebook.data.tokenize import IGNORE_INDEX


def _bins(order, offsets):
    return [order[offsets[b] : offsets[b + 1]].tolist() for b in range(len(offsets) - 1)]


def test_best_fit_decreasing_places_every_item_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 129, size=2000)
    order, offsets = best_fit_decreasing(lengths, 128, seed=3)
    assert sorted(order.tolist()) == list(range(2000))
    loads = [int(lengths[b].sum()) for b in map(np.asarray, _bins(order, offsets))]
    assert max(loads) <= 128
    # Best fit on uniformly distributed sizes fills rows tightly.
    assert lengths.sum() / (len(loads) * 128) > 0.95
    again = best_fit_decreasing(lengths, 128, seed=3)
    assert np.array_equal(again[0], order) and np.array_equal(again[1], offsets)


def test_best_fit_picks_the_tightest_bin():
    # 6 opens bin A (4 free), 5 opens bin B (5 free), 4 must go to A (tightest fit), then 5 fills B.
    lengths = np.array([6, 5, 4, 5])
    order, offsets = best_fit_decreasing(lengths, 10, seed=0)
    loads = sorted(int(lengths[b].sum()) for b in map(np.asarray, _bins(order, offsets)))
    assert loads == [10, 10]
    with pytest.raises(ValueError):
        best_fit_decreasing(np.array([11]), 10, seed=0)


def _tokenised(lengths, start=1):
    rows = {"input_ids": [], "labels": []}
    token = start
    for n in lengths:
        ids = list(range(token, token + n))
        token += n
        rows["input_ids"].append(ids)
        rows["labels"].append([IGNORE_INDEX] + ids[1:])
    return datasets.Dataset.from_dict(rows)


def test_pack_dataset_concatenates_examples_and_masks_each_first_token():
    lengths = [7, 3, 9, 2, 5, 4]
    source = _tokenised(lengths)
    packed, stats = pack_dataset(source, 12, seed=0)
    assert stats["examples_packed"] == 6 and stats["packed_rows"] == len(packed)
    assert stats["packing_efficiency"] == pytest.approx(sum(lengths) / (12 * len(packed)))
    seen = []
    for row in packed:
        assert len(row["input_ids"]) == sum(row["seq_lengths"]) <= 12
        start = 0
        for n in row["seq_lengths"]:
            ids = row["input_ids"][start : start + n]
            assert ids == list(range(ids[0], ids[0] + n))  # one whole example, in order
            assert row["labels"][start] == IGNORE_INDEX and row["labels"][start + 1 : start + n] == ids[1:]
            seen.append(ids[0])
            start += n
    assert sorted(seen) == sorted(ex[0] for ex in source["input_ids"])


def test_example_lengths_follow_a_selected_view():
    source = _tokenised([4, 8, 2, 6])
    assert example_lengths(source).tolist() == [4, 8, 2, 6]
    assert example_lengths(source.select([3, 0])).tolist() == [6, 4]


def test_collator_restarts_positions_and_gives_padding_its_own_segment():
    batch = PackedCollator(pad_token_id=0, pad_to_multiple_of=4)(
        [
            {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7, -100, 9], "seq_lengths": [3, 2]},
            {"input_ids": [1, 2], "labels": [-100, 2], "seq_lengths": [2]},
        ]
    )
    assert batch["input_ids"].shape == (2, 8)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5]]
    assert batch["seq_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1]]
    assert batch["attention_mask"].sum().item() == 7
    assert (batch["labels"][:, 5:] == IGNORE_INDEX).all() and torch.equal(
        batch["input_ids"][1, 2:], torch.zeros(6).long()
    )


def test_segment_attention_gets_example_boundaries_and_matches_masked_sdpa():
    batch = PackedCollator(pad_token_id=0)(
        [{"input_ids": list(range(1, 8)), "labels": list(range(1, 8)), "seq_lengths": [3, 4]},
         {"input_ids": list(range(1, 6)), "labels": list(range(1, 6)), "seq_lengths": [5]}]
    )  # fmt: skip
    inputs = attention_inputs(batch, SEGMENT_SDPA, torch.float32)
    assert inputs["cu_seq_lens_q"].tolist() == [0, 3, 7, 12, 14] and "attention_mask" not in inputs
    assert inputs["max_length_q"] == 5

    class Attn(torch.nn.Module):  # what transformers passes as `module`
        training = False

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 7, 8, generator=g)
    k, v = torch.randn(2, 2, 7, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g)  # grouped-query heads
    out, _ = segment_sdpa_attention(Attn(), q, k, v, None, scaling=0.3, cu_seq_lens_q=inputs["cu_seq_lens_q"])
    mask = attention_inputs(batch, "sdpa", torch.float32)["attention_mask"]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.3
    )
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-6, rtol=1e-6)
