"""k accumulated micro-batches give the gradients of one batch of their union (fp32, 1e-5)."""

from __future__ import annotations

import copy

import pytest
import torch

from tunebook.data import PadCollator, build_loader
from tunebook.models import build_causal_lm
from tunebook.training import (
    accumulation_windows,
    build_accelerator,
    count_loss_tokens,
    step_loss_scale,
    token_loss_sum,
)

TOL = 1e-5


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _examples(tokenizer, n=7):
    """Examples of very different lengths and loss-token counts, so per-micro-batch means would be wrong."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        length = 6 + 9 * (i % 4) + i
        ids = torch.randint(10, len(tokenizer), (length,), generator=g).tolist()
        prompt = 2 + (i * 3) % (length - 3)
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def _reference_step(model, rows, collate):
    """The plain computation: one padded batch of the whole step, mean over its loss tokens."""
    batch = {k: v.to(model.device) for k, v in collate(rows).items()}
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = token_loss_sum(logits, batch["labels"]) / count_loss_tokens(batch["labels"])
    loss.backward()


@pytest.mark.parametrize("k, batch_size", [(3, 2), (2, 1), (4, 2)])
def test_accumulated_steps_equal_union_batches(
    k, batch_size, tiny_tokenizer, tiny_model_config, fresh_accelerate_state
):
    torch.manual_seed(0)
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config, attn_implementation="eager")
    reference = copy.deepcopy(model)
    rows = _examples(tiny_tokenizer)
    collate = PadCollator(tiny_tokenizer.pad_token_id, pad_to_multiple_of=None)
    loader = build_loader(rows, batch_size, collate, shuffle=False, seed=0)

    accelerator = build_accelerator(k)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    reference.to(accelerator.device)  # on a GPU machine Accelerate moved the model there: compare like with like

    steps, offset = 0, 0
    for _epoch in range(2):  # the second epoch checks the accumulation counter restarts cleanly
        for window in accumulation_windows(loader, k):
            local_tokens = sum(count_loss_tokens(b["labels"]) for b in window)
            scale = step_loss_scale(accelerator.reduce(local_tokens, "sum"), accelerator.num_processes, k)
            for batch in window:
                with accelerator.accumulate(model):
                    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                    accelerator.backward(token_loss_sum(logits, batch["labels"]) * scale)
            n = sum(len(b["input_ids"]) for b in window)
            _reference_step(reference, rows[offset % len(rows) : offset % len(rows) + n], collate)
            offset += n
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad, atol=TOL, rtol=TOL, msg=f"gradient of {name}")
            assert accelerator.sync_gradients
            optimizer.step()
            optimizer.zero_grad()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            steps += 1
    assert steps == 2 * -(-len(loader) // k)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=TOL, rtol=TOL)


def test_per_micro_batch_means_would_fail_this_comparison(tiny_tokenizer, tiny_model_config):
    """The comparison above is sensitive: averaging micro-batch means differs from the union's token mean."""
    torch.manual_seed(0)
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config, attn_implementation="eager")
    reference = copy.deepcopy(model)
    rows = _examples(tiny_tokenizer, 4)
    collate = PadCollator(tiny_tokenizer.pad_token_id)
    for part in (rows[:1], rows[1:]):
        batch = collate(part)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        (token_loss_sum(logits, batch["labels"]) / count_loss_tokens(batch["labels"]) / 2).backward()
    _reference_step(reference, rows, collate)
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    assert diff > 100 * TOL
