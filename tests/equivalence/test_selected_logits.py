"""The LM head run only at loss-bearing positions gives the losses and gradients of the full-logits loss (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from tunebook.data import PackedCollator, PadCollator, attention_inputs, loss_positions, use_packed_attention
from tunebook.models import build_causal_lm
from tunebook.training import causal_lm_token_losses, output_layer_at, per_example_token_loss

TOL = 1e-5


def _rows(tokenizer, lengths, prompt=3):
    g = torch.Generator().manual_seed(1)
    rows = []
    for n in lengths:
        ids = torch.randint(10, len(tokenizer), (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def _padded(tokenizer):
    return PadCollator(tokenizer.pad_token_id, 8)(_rows(tokenizer, (5, 17, 11)))


def _packed(tokenizer):
    examples = _rows(tokenizer, (7, 9, 12, 6, 10))
    rows = []
    for group in ([0, 1, 2], [3, 4]):
        ids = [t for i in group for t in examples[i]["input_ids"]]
        labels = []
        for i in group:  # the packer masks the first label of each example
            labels += [-100] + examples[i]["labels"][1:]
        rows.append(
            {"input_ids": ids, "labels": labels, "seq_lengths": [len(examples[i]["input_ids"]) for i in group]}
        )
    return PackedCollator(tokenizer.pad_token_id, 8)(rows)


def _loss_and_grads(model, batch, attn, selected: bool):
    model.zero_grad(set_to_none=True)
    inputs = attention_inputs(batch, attn, model.dtype)
    if selected:
        losses, positions = causal_lm_token_losses(model, inputs, batch)
        rows = positions // batch["labels"].shape[1]
        sums = torch.zeros(len(batch["labels"])).index_add(0, rows, losses.detach())
    else:
        sums = per_example_token_loss(model(**inputs).logits, batch["labels"])[0]
        losses = sums
    (losses.sum() / 100).backward()
    return sums.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["padded", "packed"])
@pytest.mark.parametrize("tied", [False, True])
def test_selected_logits_equal_full_logits(tiny_tokenizer, tiny_model_config, kind, tied):
    torch.manual_seed(0)
    model = build_causal_lm(tiny_tokenizer, model_config={**tiny_model_config, "tie_word_embeddings": tied})
    model.train()
    batch = _padded(tiny_tokenizer) if kind == "padded" else _packed(tiny_tokenizer)
    attn = use_packed_attention(model, "cpu") if kind == "packed" else model.config._attn_implementation
    assert batch["loss_targets"].numel() == (batch["labels"][:, 1:] != -100).sum()
    full_sums, full_grads = _loss_and_grads(model, batch, attn, selected=False)
    sel_sums, sel_grads = _loss_and_grads(model, batch, attn, selected=True)
    torch.testing.assert_close(sel_sums, full_sums, atol=TOL, rtol=TOL)
    assert sel_grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(sel_grads[name], grad, atol=TOL, rtol=TOL, msg=f"gradient of {name}")


def test_output_layer_hook_is_removed_and_fallback_picks_positions(tiny_tokenizer, tiny_model_config):
    torch.manual_seed(0)
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config).eval()
    batch = _padded(tiny_tokenizer)
    positions = batch["loss_positions"]
    with torch.no_grad(), output_layer_at(model, positions):
        inside = model(**attention_inputs(batch, "sdpa", model.dtype)).logits
        assert inside.shape == (positions.numel(), len(tiny_tokenizer))
    with torch.no_grad():
        full = model(**attention_inputs(batch, "sdpa", model.dtype)).logits  # the hook is gone
    assert full.shape[:2] == batch["input_ids"].shape
    torch.testing.assert_close(inside, full.flatten(0, 1)[positions], atol=TOL, rtol=TOL)
    # A model that makes its logits without calling its output layer module: the positions are picked afterwards.
    model.get_output_embeddings = lambda: torch.nn.Identity()
    without = {k: v for k, v in batch.items() if not k.startswith("loss_")}  # also: computed when absent
    with torch.no_grad():
        losses, got = causal_lm_token_losses(model, attention_inputs(batch, "sdpa", model.dtype), without)
    assert torch.equal(got, positions)
    expected = per_example_token_loss(full, batch["labels"])[0].sum()
    torch.testing.assert_close(losses.sum(), expected, atol=TOL, rtol=TOL)
    assert loss_positions(batch["labels"])["loss_targets"].tolist() == batch["loss_targets"].tolist()
