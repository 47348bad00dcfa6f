from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch

from tunebook.data.collate import PackedCollator
from tunebook.data.packing import best_fit_decreasing, example_lengths, pack_dataset
from tunebook.data.tokenize import IGNORE_INDEX
from tunebook.models.attention import SEGMENT_SDPA, attention_inputs, document_block_mask, segment_sdpa_attention


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
    assert "max_length_q" not in inputs  # a graph constant under torch_compile: the attention reads it from cu

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


def _document_rows(length: int, longest: int, rows: int, seed: int) -> torch.Tensor:
    """Segment ids of `rows` packed rows of `length` tokens, examples of 1 to `longest` tokens, as the collator
    numbers them (0, 0, 1, 1, 1, 2, ...)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        lengths, total = [], 0
        while total < length:
            lengths.append(min(int(torch.randint(1, longest + 1, (1,), generator=g)), length - total))
            total += lengths[-1]
        out.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack(out)


@pytest.mark.parametrize("length", [1, 100, 128, 129, 300, 640])
@pytest.mark.parametrize("longest", [5, 150, 700])
def test_block_mask_tiles_from_boundaries_equal_torchs_create_block_mask(length, longest):
    """The tiles read off the segment ids equal `create_block_mask`'s evaluation of every pair, index for index,
    including rows whose length is not a multiple of the 128-token tile and examples longer than a tile."""
    from torch.nn.attention.flex_attention import create_block_mask

    seq = _document_rows(length, longest, rows=3, seed=length * longest)
    padded = torch.nn.functional.pad(seq, (0, -length % 128), value=-1)

    def document_causal(b, h, q, kv):
        return (padded[b, q] == padded[b, kv]) & (q >= kv)

    ref = create_block_mask(document_causal, 3, None, length, length, device="cpu")
    ours = document_block_mask(seq)
    for name, a, b in zip(("seq_lengths", *ref.__dict__), ref.as_tuple(), ours.as_tuple()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    dense = (seq[:, None, :, None] == seq[:, None, None, :]) & causal
    assert torch.equal(ours.to_dense().bool(), ref.to_dense().bool())
    # The tiles cover every allowed pair, and tiles marked full hold no forbidden pair.
    tiles = ours.to_dense().bool().repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :length, :length]
    assert not (dense & ~tiles).any()
    full = _full_tiles(ours, length)
    assert not (full & ~dense).any()


def _full_tiles(mask, length):
    """The positions of the tiles a BlockMask lists as full, as a dense (batch, 1, length, length) boolean."""
    n = mask.full_kv_indices.shape[-1]
    tiles = torch.zeros(*mask.full_kv_indices.shape[:2], n, n, dtype=torch.bool)
    for b, h, q in np.ndindex(*mask.full_kv_num_blocks.shape):
        tiles[b, h, q, mask.full_kv_indices[b, h, q, : mask.full_kv_num_blocks[b, h, q]].long()] = True
    return tiles.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :length, :length]


def test_flex_attention_tiles_are_made_in_the_loaders_worker_and_used_on_the_device_side():
    """With `attn_implementation="flex_attention"` the collator adds the block mask's tiles (as tensors, so a worker
    can send them and accelerate moves them to the device); `attention_inputs` builds the same BlockMask from them
    as from the segment ids alone. Other backends get no tiles."""
    rows = [
        {"input_ids": list(range(1, 301)), "labels": list(range(1, 301)), "seq_lengths": [40, 200, 60]},
        {"input_ids": list(range(1, 201)), "labels": list(range(1, 201)), "seq_lengths": [130, 70]},
    ]
    loader = torch.utils.data.DataLoader(
        rows, batch_size=2, num_workers=1, collate_fn=PackedCollator(0, 8, attn_implementation="flex_attention")
    )
    batch = next(iter(loader))
    assert batch["block_mask_kv_indices"].shape == (2, 1, 3, 3) and batch["block_mask_kv_indices"].dtype == torch.int32
    given = attention_inputs(batch, "flex_attention", torch.float32)["attention_mask"]
    del batch["block_mask_kv_indices"]
    derived = attention_inputs(batch, "flex_attention", torch.float32)["attention_mask"]
    assert torch.equal(given.to_dense(), derived.to_dense())
    for a, b in zip(given.as_tuple(), derived.as_tuple()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    assert given.full_kv_num_blocks[1, 0].tolist() == [0, 0, 0]  # row 2: tile 1 starts inside example 0, ends in 1
    # The kernel (FlexAttention's eager reference on a CPU, forward only) with these tiles is SDPA with the dense mask.
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, batch["seq_ids"].shape[1], 16, generator=g) for _ in range(3))
    dense = attention_inputs(batch, "sdpa", torch.float32)["attention_mask"]
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=given),
                               torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense))  # fmt: skip
    assert not any(k.startswith("block_mask_") for k in PackedCollator(0, 8, attn_implementation="sdpa")(rows))
