"""Packed rows with images train exactly as their examples alone: per-token losses and gradients, for LLaVA (1-D
positions, a fixed 4 image tokens an image) and Qwen2-VL / Qwen2.5-VL (3-D rotary positions from each example's
own image grids), on the CPU's packed-attention backends.

float32 throughout: the packed and the lone forward run the same matmuls over differently shaped batches, so they
differ by reordered float32 sums only (relative ~1e-6); 1e-5 leaves room and still fails by orders of magnitude
when one example sees another (the last tests: a changed neighbour leaves an example's losses alone, and the
comparison catches a row whose examples are not kept apart).
"""

from __future__ import annotations

import io

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tunebook.config.tiny import TINY_LLAVA, TINY_QWEN2_5_VL, TINY_QWEN2_VL
from tunebook.data.packing import pack_dataset
from tunebook.data.tokenize import IGNORE_INDEX
from tunebook.data.vision_collate import VisionPackedCollator
from tunebook.errors import ConfigError
from tunebook.models.attention import SEGMENT_SDPA, attention_inputs, use_packed_attention
from tunebook.models.tokenizer import train_chat_tokenizer
from tunebook.models.vision import build_vision_lm, tiny_processor

TOL = 1e-5
CONFIGS = {"llava": TINY_LLAVA, "qwen2_vl": TINY_QWEN2_VL, "qwen2_5_vl": TINY_QWEN2_5_VL}
# (height, width) of each example's images: different sizes give Qwen-VL different grids (non-square ones too, whose
# height and width positions differ), one example has two images and one none.
IMAGES = [[(28, 56)], [(56, 56), (28, 28)], [], [(56, 28)], [(28, 28)]]
QUESTIONS = ["what is in the picture?", "and these two?", "say something.", "what colour is it?", "and now?"]
ANSWERS = ["a red square", "two green circles", "hello there", "blue", "a small triangle"]


@pytest.fixture(scope="module")
def processors():
    tokenizer = train_chat_tokenizer([" ".join(QUESTIONS + ANSWERS)] * 20, vocab_size=300)
    return {family: tiny_processor(config, tokenizer) for family, config in CONFIGS.items()}


def _png(height: int, width: int, seed: int) -> dict:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return {"bytes": out.getvalue(), "path": None}


def _examples(processor, image_seed: int = 0, answers=ANSWERS) -> datasets.Dataset:
    """The conversations tokenised with their images' tokens expanded; loss on everything but the image tokens."""
    rows = {"input_ids": [], "labels": [], "images": [], "where": [], "text": []}
    for k, (sizes, question, answer) in enumerate(zip(IMAGES, QUESTIONS, answers)):
        content = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": question}]
        messages = [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
        text = processor.apply_chat_template(messages, tokenize=False)
        references = [_png(h, w, image_seed * 100 + k * 10 + j) for j, (h, w) in enumerate(sizes)]
        images = [Image.open(io.BytesIO(r["bytes"])) for r in references] or None
        ids = processor(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
        rows["input_ids"].append(ids)
        rows["labels"].append([IGNORE_INDEX if t == processor.image_token_id else t for t in ids])
        rows["images"].append(references)
        rows["where"].append(f"row {k + 1}")
        rows["text"].append(text)
    return datasets.Dataset.from_dict(rows)


def _model(processor, family: str, attn: str):
    torch.manual_seed(0)
    model = build_vision_lm(processor, model_config=CONFIGS[family], attn_implementation="sdpa").float()
    return model, use_packed_attention(model, "cpu", 256) if attn == SEGMENT_SDPA else attn


def _packed_batch(processor, model, examples: datasets.Dataset, attn: str) -> tuple[dict, datasets.Dataset]:
    packed, _ = pack_dataset(examples, 256, seed=0, carry=("images", "where"))
    assert len(packed) == 1 and len(packed[0]["seq_lengths"]) == len(IMAGES)  # one row holds every example
    batch = VisionPackedCollator(processor, model.config, None, attn)(list(packed))
    return batch, packed


def _alone(processor, model, example: dict) -> torch.Tensor:
    """An example's per-token losses as the model computes them for it alone, unpacked, its positions its own."""
    images = [Image.open(io.BytesIO(r["bytes"])) for r in example["images"]] or None
    inputs = processor(text=[example["text"]], images=images, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == example["input_ids"]
    logits = model(**inputs, use_cache=False).logits
    return _token_losses(logits[0], inputs["input_ids"][0], torch.tensor(example["labels"]))


def _token_losses(logits, ids, labels) -> torch.Tensor:
    losses = F.cross_entropy(logits[:-1].float(), ids[1:], reduction="none")
    return losses.masked_fill(labels[1:] == IGNORE_INDEX, 0.0)


def _in_row(logits, batch, packed) -> list[torch.Tensor]:
    """Each packed example's per-token losses, read off the row (the same labels as alone: its first is ignored)."""
    out, start = [], 0
    for n in packed[0]["seq_lengths"]:
        span = slice(start, start + n)
        labels = batch["labels"][0, span].clone()
        out.append(_token_losses(logits[0, span], batch["input_ids"][0, span], labels))
        start += n
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager", SEGMENT_SDPA])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_packed_token_losses_and_gradients_equal_each_example_alone(processors, family, attn):
    processor = processors[family]
    model, attn = _model(processor, family, attn)
    examples = _examples(processor)
    batch, packed = _packed_batch(processor, model, examples, attn)
    if family != "llava":  # the 3-D positions restart with each example: the rotary sees each one as alone
        assert batch["rope_position_ids"].shape == (1, 3, batch["input_ids"].shape[1])
    row = _in_row(model(**attention_inputs(batch, attn, torch.float32)).logits, batch, packed)
    sum(r.sum() for r in row).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    # The packing order (longest first) differs from the data's: match each packed example by its tokens.
    by_ids = {tuple(e["input_ids"]): e for e in examples}
    start = 0
    for n, in_row in zip(packed[0]["seq_lengths"], row):
        example = by_ids[tuple(batch["input_ids"][0, start : start + n].tolist())]
        alone = _alone(processor, model, example)
        torch.testing.assert_close(in_row, alone, rtol=TOL, atol=TOL)
        alone.sum().backward()  # gradients accumulate over the examples alone
        start += n
    assert len(packed_grads) > 10
    for name, p in model.named_parameters():
        if name in packed_grads:
            torch.testing.assert_close(packed_grads[name], p.grad, rtol=TOL, atol=TOL, msg=name)


def _changed_first(examples: datasets.Dataset, packed: datasets.Dataset) -> datasets.Dataset:
    """The examples with the one packed first in the row given other pixels (same size) and another answer token."""
    first = [len(ids) for ids in examples["input_ids"]].index(packed[0]["seq_lengths"][0])  # lengths differ

    def change(row, k):
        if k == first:
            row["images"] = [_png(*Image.open(io.BytesIO(r["bytes"])).size[::-1], seed=999) for r in row["images"]]
            row["input_ids"] = row["input_ids"][:-3] + [(row["input_ids"][-3] + 1) % 300] + row["input_ids"][-2:]
        return row

    return examples.map(change, with_indices=True)


def _losses_by_example(model, batch, packed, inputs) -> dict[tuple, torch.Tensor]:
    with torch.no_grad():
        row = _in_row(model(**inputs).logits, batch, packed)
    starts = np.cumsum([0, *packed[0]["seq_lengths"]])
    return {tuple(batch["input_ids"][0, s:e].tolist()): r for s, e, r in zip(starts, starts[1:], row)}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_examples_do_not_see_each_other_and_the_check_catches_a_row_that_lets_them(processors, family):
    processor = processors[family]
    model, attn = _model(processor, family, SEGMENT_SDPA)
    examples = _examples(processor)

    def losses(data: datasets.Dataset):
        batch, packed = _packed_batch(processor, model, data, attn)
        isolated = attention_inputs(batch, attn, torch.float32)
        # What a row whose examples are not kept apart gives: one causal attention over the whole row.
        leaky = {k: v for k, v in isolated.items() if not k.startswith("cu_seq_lens")}
        leaky["attention_mask"] = torch.ones_like(batch["input_ids"])
        return packed, [_losses_by_example(model, batch, packed, inputs) for inputs in (isolated, leaky)]

    packed, (isolated, leaky) = losses(examples)
    _, (isolated_changed, leaky_changed) = losses(_changed_first(examples, packed))
    unchanged = set(isolated) & set(isolated_changed)
    assert len(unchanged) == len(IMAGES) - 1  # only the first example's tokens changed
    for ids in unchanged:  # an example's losses do not move when its neighbour's image and text do
        torch.testing.assert_close(isolated_changed[ids], isolated[ids], rtol=TOL, atol=TOL)
    # The changed example's own losses move (the change reaches the model), and with one attention over the row
    # so do the losses of the examples after it: the comparison above would catch a leak.
    (changed,) = set(isolated_changed) - unchanged
    (before,) = set(isolated) - unchanged
    assert not torch.allclose(isolated_changed[changed][:-3], isolated[before][:-3], rtol=TOL, atol=TOL)
    moved = [(leaky_changed[ids] - leaky[ids]).abs().max().item() for ids in unchanged]
    assert max(moved) > 100 * TOL, moved


def test_a_family_packing_does_not_keep_exact_is_refused_with_one_line(processors):
    gemma_like = type("Config", (), {"model_type": "gemma3", "vision_config": object()})()
    model = type("Gemma3ForConditionalGeneration", (), {"config": gemma_like})()
    with pytest.raises(ConfigError) as error:
        use_packed_attention(model, "cpu", 256)
    message = str(error.value)
    assert "\n" not in message and "gemma3" in message and "set packing: false" in message
    assert "llava, qwen2_vl, qwen2_5_vl" in message
    with pytest.raises(ConfigError, match="gemma3"):  # the collator refuses it too, before any worker starts
        VisionPackedCollator(processors["llava"], gemma_like)
