"""k accumulated micro-batches give the gradients of one batch of their union, to float32's rounding.

The tolerance is derived, not picked: a gradient element is a sum over the step's token positions, and a sum of R
float32 terms computed in another order (other batch shapes, another accumulation) may differ by up to about
R x u x the terms' size (u = 2**-24, float32's unit roundoff; Higham, "Accuracy and Stability of Numerical
Algorithms", 4.2). Each parameter's gradient is compared with `SAFETY` x R x u x its largest element, so an element
that cancels to almost nothing is not held to a relative tolerance it cannot meet (a fixed 1e-5 failed on 2 of 9,600
embedding gradients once), while a per-micro-batch mean, which is off by a factor, still fails it by orders of
magnitude (`test_per_micro_batch_means_would_fail_this_comparison`). Each step is compared from the same weights: the
flaky failure was the second epoch's gradients taken at weights that earlier steps' rounding had already moved apart
(1.2e-5 on 86 embedding gradients once measured against this tolerance).
"""

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

UNIT_ROUNDOFF = torch.finfo(torch.float32).eps / 2
# Forward and backward pass a token's contribution through a few roundings each (two layers here); measured over 30
# seeds and the three shapes below, the largest difference was 0.66 x R x u x max|gradient|.
SAFETY = 8.0


def gradient_tolerance(reference: torch.Tensor, reduction: int) -> float:
    """Absolute tolerance of a float32 gradient that sums `reduction` terms, scaled by its largest element."""
    return SAFETY * reduction * UNIT_ROUNDOFF * reference.abs().max().item()


def assert_gradients_close(model, reference, reduction: int) -> float:
    """Every parameter's gradient within `gradient_tolerance`; returns the largest difference in tolerances."""
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        tol = gradient_tolerance(q.grad, reduction)
        torch.testing.assert_close(p.grad, q.grad, atol=tol, rtol=0, msg=f"gradient of {name}")
        worst = max(worst, (p.grad - q.grad).abs().max().item() / tol if tol else 0.0)
    return worst


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


def _reference_step(model, rows, collate) -> int:
    """The plain computation: one padded batch of the whole step, mean over its loss tokens. Returns the number of
    token positions its gradients sum over."""
    batch = {k: v.to(model.device) for k, v in collate(rows).items()}
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = token_loss_sum(logits, batch["labels"]) / count_loss_tokens(batch["labels"])
    loss.backward()
    return int(batch["attention_mask"].sum())


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
            # Both start the step from the same weights: rounding differences of earlier steps, which SGD carries on
            # and the model amplifies, would otherwise be counted against this step's gradients.
            reference.load_state_dict(accelerator.unwrap_model(model).state_dict())
            reduction = _reference_step(reference, rows[offset % len(rows) : offset % len(rows) + n], collate)
            offset += n
            assert_gradients_close(model, reference, reduction)
            # After the step, each weight differs by lr x its gradient's difference, plus the update's rounding.
            weight_tolerance = {
                name: 0.5 * gradient_tolerance(q.grad, reduction) + UNIT_ROUNDOFF * q.abs().max().item()
                for name, q in reference.named_parameters()
            }
            assert accelerator.sync_gradients
            optimizer.step()
            optimizer.zero_grad()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            steps += 1
    assert steps == 2 * -(-len(loader) // k)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=weight_tolerance[name], rtol=0, msg=f"weights of {name}")


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
    reduction = _reference_step(reference, rows, collate)
    with pytest.raises(AssertionError, match="gradient of"):
        assert_gradients_close(model, reference, reduction)
    # Not at the edge: the wrong normalisation is off by far more than rounding could explain.
    worst = max(
        (p.grad - q.grad).abs().max().item() / gradient_tolerance(q.grad, reduction)
        for p, q in zip(model.parameters(), reference.parameters())
    )
    assert worst > 100
