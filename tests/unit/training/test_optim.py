"""The optimizer: AdamW without decay on 1-D parameters, fused, and the same updates as torch's plain AdamW."""

from __future__ import annotations

import torch

from tunebook.training import build_optimizer


def test_fused_adamw_updates_as_the_plain_one_does():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    plain = [p.detach().clone().requires_grad_() for p in model.parameters()]
    optimizer = build_optimizer(model, 1e-2, 0.1, (0.9, 0.95), 1e-8)
    assert optimizer.defaults["fused"] is True
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    decay = [p for p in plain if p.ndim >= 2]
    reference = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": [p for p in plain if p.ndim < 2], "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False,
    )  # fmt: skip
    for _ in range(5):
        x = torch.randn(8, 16)
        for params, opt in ((list(model.parameters()), optimizer), (plain, reference)):
            out = torch.nn.functional.linear(x, params[0], params[1])
            out = torch.nn.functional.layer_norm(out, (32,), params[2], params[3])
            torch.nn.functional.linear(out, params[4], params[5]).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(model.parameters(), plain):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
