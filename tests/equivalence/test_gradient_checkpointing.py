"""Gradient checkpointing recomputes activations in backward: same gradients as storing them (fp32, 1e-5)."""

from __future__ import annotations

import torch

from tunebook.data import PadCollator
from tunebook.models import build_causal_lm
from tunebook.training import count_loss_tokens, token_loss_sum

TOL = 1e-5


def _gradients(tokenizer, model_config, checkpointing: bool):
    torch.manual_seed(0)
    model = build_causal_lm(tokenizer, model_config=model_config, gradient_checkpointing=checkpointing)
    model.train()
    active = getattr(model, "is_activation_checkpointing", None)
    assert (model.is_gradient_checkpointing if active is None else active) == checkpointing
    g = torch.Generator().manual_seed(1)
    rows = []
    for length in (5, 17, 11):
        ids = torch.randint(10, len(tokenizer), (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * 2 + ids[2:]})
    batch = PadCollator(tokenizer.pad_token_id, 8)(rows)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    (token_loss_sum(logits, batch["labels"]) / count_loss_tokens(batch["labels"])).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_checkpointed_gradients_equal_plain_ones(tiny_tokenizer, tiny_model_config):
    plain = _gradients(tiny_tokenizer, tiny_model_config, checkpointing=False)
    checkpointed = _gradients(tiny_tokenizer, tiny_model_config, checkpointing=True)
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=TOL, rtol=TOL, msg=f"gradient of {name}")
