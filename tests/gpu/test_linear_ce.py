"""On a CUDA GPU: the fused LM-head loss under bf16 autocast, with the backward that CUDA picks by itself (slices of
the vocabulary when it is larger than the rows) and with row chunks, gives the unfused loss and its gradients.

Skipped without CUDA (CI has none); run on a GPU machine with `pytest -m gpu`. bf16 matmuls round differently in
each path, so gradients are compared by their relative error (1e-2), losses to 2e-3.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tunebook.models.linear_ce as linear_ce
from tunebook.models.linear_ce import linear_cross_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _losses_and_grads(loss_fn, hidden, weight, bias, targets, scale):
    h, w, b = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        losses = loss_fn(h, w, b, targets)
    (losses * scale).sum().backward()
    return losses.detach().float(), h.grad.float(), w.grad.float(), b.grad.float()


def _relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("strategy", [None, False])  # CUDA's own choice (the vocabulary here), then row chunks
def test_fused_loss_on_cuda_equals_the_unfused_loss_in_bf16(monkeypatch, strategy):
    rows, hidden_size, vocab = 3000, 256, 20000  # several chunks either way, and a last partial one
    monkeypatch.setattr(linear_ce, "CHUNK_ELEMENTS", 2**23)
    monkeypatch.setattr(linear_ce, "VOCAB_BACKWARD", strategy)
    calls = []
    vocab_backward = linear_ce._vocab_backward
    monkeypatch.setattr(linear_ce, "_vocab_backward", lambda *args: calls.append(1) or vocab_backward(*args))
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(rows, hidden_size, device="cuda", generator=g)
    weight = torch.randn(vocab, hidden_size, device="cuda", generator=g) * hidden_size**-0.5  # float32, as trained
    bias = torch.randn(vocab, device="cuda", generator=g) * 0.1
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    targets[-1] = vocab - 1  # a target in the last, partial slice
    scale = torch.rand(rows, device="cuda", generator=g)  # per-token weights, as DPO's sequence sums give

    def unfused(h, w, b, t):
        return F.cross_entropy(F.linear(h, w, b).float(), t, reduction="none")

    expected = _losses_and_grads(unfused, hidden, weight, bias, targets, scale)
    fused = _losses_and_grads(linear_cross_entropy, hidden, weight, bias, targets, scale)
    assert bool(calls) == (strategy is None)  # CUDA picked the vocabulary slices by itself
    torch.testing.assert_close(fused[0], expected[0], rtol=2e-3, atol=2e-3)
    for name, got, want in zip(("hidden", "weight", "bias"), fused[1:], expected[1:]):
        assert _relative_error(got, want) < 1e-2, name
