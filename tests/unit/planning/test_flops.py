"""The MFU arithmetic against a count by hand for a tiny Llama."""

from __future__ import annotations

import datasets
import pytest

from tunebook.models import build_causal_lm
from tunebook.planning.flops import attention_span, dataset_flop_shape, mfu, model_flops_per_token


def test_model_flops_per_token_matches_a_hand_count(tiny_tokenizer, tiny_model_config):
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config)
    vocab = model.config.vocab_size
    # hidden 32, 4 heads of 8, 2 KV heads (k/v project to 16), gated MLP of 64, 2 layers, untied head.
    per_layer = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 3 * 32 * 64
    assert per_layer == 9216
    linear = 2 * per_layer + 32 * vocab * 0.5  # the LM head runs for the half of the tokens that carry a label
    attention = 12 * 2 * 4 * 8 * 10  # layers x heads x head_dim x T
    assert model_flops_per_token(model, seq_len=10, head_fraction=0.5) == pytest.approx(6 * linear + attention)
    # 1000 tokens/s on 2 devices of 1e6 FLOP/s each.
    assert mfu(1000.0, 1000.0, 2, 1e6) == pytest.approx(0.5)
    assert mfu(1000.0, 1000.0, 1, None) is None


def test_attention_span_of_packed_and_padded_data():
    assert attention_span([8]) == 8  # one full row
    assert attention_span([2, 2, 4]) == pytest.approx((4 + 4 + 16) / 8)
    packed = datasets.Dataset.from_dict(
        {"input_ids": [[1] * 8, [1] * 4], "labels": [[-100] * 4 + [1] * 4, [1] * 4], "seq_lengths": [[2, 6], [4]]}
    )
    span, fraction = dataset_flop_shape(packed)
    assert span == pytest.approx((4 + 36 + 16) / 12) and fraction == pytest.approx(8 / 12)
    rows = datasets.Dataset.from_dict({"input_ids": [[1] * 3, [1] * 5], "labels": [0, 1]})
    assert dataset_flop_shape(rows) == (pytest.approx((9 + 25) / 8), 1.0)
