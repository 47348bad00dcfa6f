"""k accumulated micro-batches of image-text rows give the gradients of one batch of their union, to float32's rounding,
for Qwen2-VL (image tokens by the picture's size, `image_grid_thw`) and LLaVA (a fixed 4 per picture).

The accumulated side is recipes/sft.py's step: rows with image files, collated by `VisionCollator` (the pictures
decoded and run through the image processor per micro-batch), `attention_inputs` and `causal_lm_token_losses`, scaled
by `step_loss_scale` over the step's loss tokens. The reference is the plain computation: the union of the step's rows
through the processor itself (text and pictures together, as transformers documents it), the model's full logits, and
the mean next-token cross-entropy over the loss tokens. Rows hold one or two pictures of five sizes and answers of
different lengths, so micro-batches differ in length, image count and loss tokens: per-micro-batch means would fail.

The tolerance is tests/equivalence/test_grad_accumulation.py's, derived there: a gradient element sums R float32 terms
(R: the token positions and image patches of the step), so another order of summation may move it by up to about
R x u x its size (u = 2**-24), times a safety factor for the few roundings on the way.
"""

from __future__ import annotations

import copy

import pytest
import torch
from PIL import Image

from tunebook.config.tiny import TINY_LLAVA, TINY_QWEN2_VL
from tunebook.data import build_loader
from tunebook.data.vision_collate import VisionCollator
from tunebook.models import attention_inputs
from tunebook.models.tokenizer import train_chat_tokenizer
from tunebook.models.vision import build_vision_lm, tiny_processor
from tunebook.training import (
    accumulation_windows,
    build_accelerator,
    causal_lm_token_losses,
    count_loss_tokens,
    step_loss_scale,
    token_loss_sum,
)

FAMILIES = {"qwen2_vl": TINY_QWEN2_VL, "llava": TINY_LLAVA}
UNIT_ROUNDOFF = torch.finfo(torch.float32).eps / 2
SAFETY = 8.0  # test_grad_accumulation.py's; the largest measured here was well under it
SIZES = [(28, 28), (56, 28), (28, 56), (56, 56), (84, 56)]  # width x height: 1 to 6 Qwen-VL image tokens
ANSWERS = ["red", "a blue square", "green, on the left of a small yellow circle", "no", "two red triangles"]


@pytest.fixture(scope="module")
def processors():
    tokenizer = train_chat_tokenizer(["what colour is the square? " + " ".join(ANSWERS)] * 20, vocab_size=300)
    return {family: tiny_processor(config, tokenizer, max_image_pixels=96 * 96) for family, config in FAMILIES.items()}


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _rows(processor, folder, n=7) -> list[dict]:
    """Rows as the vision data path caches them: token ids with each picture's image tokens expanded, labels on the
    answer only, the pictures as file references (decoded by the collator), and `where`."""
    rows = []
    for i in range(n):
        pictures = []
        for k in range(1 + (i % 3 == 0)):
            path = folder / f"{i}-{k}.png"
            Image.new("RGB", SIZES[(i + k) % len(SIZES)], (40 * i % 256, 90 * k, 200 - 20 * i)).save(path)
            pictures.append(path)
        question = [*([{"type": "image"}] * len(pictures)), {"type": "text", "text": "what colour is the square?"}]
        messages = [{"role": "user", "content": question},
                    {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[i % len(ANSWERS)]}]}]  # fmt: skip
        images = [Image.open(p).convert("RGB") for p in pictures]
        whole = processor.apply_chat_template(messages, tokenize=False)
        prompt = processor.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        ids = processor(text=[whole], images=[images])["input_ids"][0]
        start = len(processor(text=[prompt], images=[images])["input_ids"][0])
        rows.append({"input_ids": list(ids), "labels": [-100] * start + list(ids[start:]), "text": whole,
                     "images": [{"path": str(p), "bytes": None} for p in pictures], "where": f"row {i + 1}"})  # fmt: skip
    return rows


def _reference_step(model, rows, processor) -> int:
    """The plain computation on the union of `rows`; returns R, the token positions and image patches its gradients
    sum over."""
    images = [[Image.open(r["path"]).convert("RGB") for r in row["images"]] for row in rows]
    processor.tokenizer.padding_side = "right"
    inputs = processor(text=[row["text"] for row in rows], images=images, padding=True, return_tensors="pt")
    width = inputs["input_ids"].shape[1]
    labels = torch.tensor([row["labels"] + [-100] * (width - len(row["labels"])) for row in rows])
    assert torch.equal(labels != -100, (labels == inputs["input_ids"]) & (labels != -100))  # the same tokens
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    logits = model(**inputs).logits
    (token_loss_sum(logits, labels.to(model.device)) / count_loss_tokens(labels)).backward()
    patches = inputs["pixel_values"].shape[0] if "image_grid_thw" in inputs else inputs["pixel_values"].numel() // 588
    return int(inputs["attention_mask"].sum()) + patches  # 588 = 3 x 14 x 14, one LLaVA patch


def _assert_gradients_close(model, reference, reduction: int) -> None:
    grads = {name: q.grad for name, q in reference.named_parameters()}
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:  # a part no output reads (CLIP's post-layernorm: LLaVA takes the last layer's states)
            assert p.grad is None or not p.grad.any(), name
            continue
        # A bias's gradient sums the same terms as its weight's, at their size: a key projection's bias (CLIP's)
        # has a gradient of exactly zero in exact arithmetic (softmax ignores a shift shared by all keys), and what
        # float32 leaves of it is rounding of terms the size of the weight's gradient, not of its own.
        scale = max(
            q.grad.abs().max().item(), _or(grads.get(name.replace(".bias", ".weight")), q.grad).abs().max().item()
        )
        tol = SAFETY * reduction * UNIT_ROUNDOFF * scale
        torch.testing.assert_close(p.grad, q.grad, atol=tol, rtol=0, msg=f"gradient of {name}")


def _or(gradient, fallback):
    return fallback if gradient is None else gradient


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k, batch_size", [(3, 2), (2, 1)])
def test_accumulated_image_batches_equal_the_union_batch(
    family, k, batch_size, processors, tmp_path, fresh_accelerate_state
):
    processor = processors[family]
    torch.manual_seed(0)
    model = build_vision_lm(processor, model_config=FAMILIES[family], attn_implementation="eager")
    reference = copy.deepcopy(model)
    rows = _rows(processor, tmp_path)
    features = [{key: row[key] for key in ("input_ids", "labels", "images", "where")} for row in rows]
    loader = build_loader(features, batch_size, VisionCollator(processor), shuffle=False, seed=0)
    accelerator = build_accelerator(k)
    model, loader = accelerator.prepare(model, loader)
    reference.to(accelerator.device)

    offset, steps = 0, 0
    for window in accumulation_windows(loader, k):
        assert any("pixel_values" in batch for batch in window)
        local_tokens = sum(count_loss_tokens(b["labels"]) for b in window)
        scale = step_loss_scale(accelerator.reduce(local_tokens, "sum"), accelerator.num_processes, k)
        for batch in window:  # recipes/sft.py's forward and backward
            with accelerator.accumulate(model):
                loss_sum = causal_lm_token_losses(model, attention_inputs(batch, "eager", model.dtype), batch)[0].sum()
                accelerator.backward(loss_sum * scale)
        n = sum(len(b["input_ids"]) for b in window)
        reduction = _reference_step(reference, rows[offset : offset + n], processor)
        offset += n
        assert accelerator.sync_gradients
        _assert_gradients_close(model, reference, reduction)
        model.zero_grad()
        reference.zero_grad()
        steps += 1
    assert steps == -(-len(loader) // k) and offset == len(rows)


def test_per_micro_batch_means_would_fail_this_comparison(processors, tmp_path):
    processor = processors["qwen2_vl"]
    torch.manual_seed(0)
    model = build_vision_lm(processor, model_config=TINY_QWEN2_VL, attn_implementation="eager")
    reference = copy.deepcopy(model)
    rows = _rows(processor, tmp_path, 4)
    collate = VisionCollator(processor)
    for part in (rows[:1], rows[1:]):
        batch = collate([{key: row[key] for key in ("input_ids", "labels", "images", "where")} for row in part])
        losses = causal_lm_token_losses(model, attention_inputs(batch, "eager", model.dtype), batch)[0]
        (losses.sum() / count_loss_tokens(batch["labels"]) / 2).backward()
    reduction = _reference_step(reference, rows, processor)
    with pytest.raises(AssertionError, match="gradient of"):
        _assert_gradients_close(model, reference, reduction)
