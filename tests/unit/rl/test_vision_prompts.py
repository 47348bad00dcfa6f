"""GRPO with images (tunebook.rl.vision_prompts): prompts with images prepared and cached, a batch's images decoded
once for a group and handed to the rewards as paths, and the log-probs of completions generated with images equal to
a plain forward of each prompt + completion with its own image, for a Qwen-VL (dynamic image tokens, 3-D rotary
positions) and a LLaVA (fixed image tokens) model."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from tunebook import load_recipe
from tunebook.config.tiny import TINY_LLAVA, TINY_QWEN2_VL
from tunebook.data.image_files import open_image
from tunebook.errors import DataError
from tunebook.models.tokenizer import train_chat_tokenizer
from tunebook.models.vision import build_vision_lm, tiny_processor
from tunebook.rl import prepare_prompt_data, reward_inputs
from tunebook.rl.grpo import Rollouts, completion_log_probs, rollout_rows, sample_completions
from tunebook.rl.vision_prompts import PromptImages, VisionPromptRows, prompt_images

QUESTION = "What colour is the square?"


def _picture(path, size, colour):
    Image.new("RGB", size, colour).save(path)
    return path


@pytest.fixture
def prompt_file(tmp_path):
    """Three shapes of prompt rows users bring: TRL's messages + images (a path relative to the file), a text prompt
    with images (placed first, as TRL does), and an inline image part with an absolute path."""
    (tmp_path / "pics").mkdir()
    red = _picture(tmp_path / "pics" / "red.png", (56, 56), (220, 40, 40))
    blue = _picture(tmp_path / "pics" / "blue.png", (112, 84), (40, 80, 220))
    rows = [
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
         "images": ["pics/red.png"], "answer": "red"},
        {"prompt": QUESTION, "images": ["pics/blue.png"], "answer": "blue"},
        {"prompt": [{"role": "system", "content": "Name colours."},
                    {"role": "user", "content": [{"type": "text", "text": QUESTION},
                                                 {"type": "image", "image": str(red)}]}],
         "images": None, "answer": "red"},
    ]  # fmt: skip
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, {"red": str(red), "blue": str(blue)}


def _config(tmp_path, train_data, **overrides):
    return load_recipe("grpo").config(
        train_data=str(train_data), model_config=TINY_QWEN2_VL, tokenizer_vocab_size=300, max_pixels=12544,
        output_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), eval_split_ratio=0.0, **overrides,
    )  # fmt: skip


def test_prompts_with_images_are_tokenised_with_their_image_tokens_cached_and_reach_the_rewards(tmp_path, prompt_file):
    path, pictures = prompt_file
    config = _config(tmp_path, path)
    data = prepare_prompt_data(config, tmp_path / "cache", logging.getLogger("test"))
    processor = data.processor
    assert processor is not None and data.stats["images"] == 3 and len(data.train) == 3
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    rows = sorted(data.train, key=lambda r: r["where"])
    # Qwen2-VL: one image token per 28 x 28 pixels: 56 x 56 -> 4, 112 x 84 -> 12
    assert [r["prompt_ids"].count(image_pad) for r in rows] == [4, 12, 4]
    for r in rows:  # the generation prompt ends every prompt: completions are exactly an assistant turn
        text = processor.tokenizer.decode(r["prompt_ids"])
        assert text.endswith("<|im_start|>assistant\n") and QUESTION in text
    assert processor.tokenizer.decode(rows[1]["prompt_ids"]).index("<|vision_start|>") < processor.tokenizer.decode(
        rows[1]["prompt_ids"]
    ).index(QUESTION)  # a text prompt's image goes first
    assert [[i["path"] for i in r["images"]] for r in rows] == [
        [pictures["red"]],
        [pictures["blue"]],
        [pictures["red"]],
    ]
    # The same config again: everything from the cache
    assert prepare_prompt_data(config, tmp_path / "cache", logging.getLogger("test")).built == []

    # A batch of the 3 prompts for 2 completions each: 6 images' pixels (each decoded once), 2 x each row's grid (t, h, w patches)
    batch = VisionPromptRows(processor, repeat=2)(rows)
    grids = batch["image_inputs"]["image_grid_thw"].tolist()
    assert grids == [[1, 4, 4], [1, 4, 4], [1, 6, 8], [1, 6, 8], [1, 4, 4], [1, 4, 4]]
    prompts, columns = reward_inputs(batch, [[1], [2], [3], [4], [5], [6]], repeat=2)
    assert columns["images"] == [[pictures["red"]]] * 2 + [[pictures["blue"]]] * 2 + [[pictures["red"]]] * 2
    assert columns["answer"] == ["red", "red", "blue", "blue", "red", "red"]
    assert set(columns) == {"images", "answer", "completion_lengths"}  # not the pixels, sizes or references


def test_a_prompt_whose_image_is_missing_is_one_line_naming_file_row_and_image(tmp_path, prompt_file):
    path, _ = prompt_file
    rows = path.read_text().splitlines()
    rows[1] = json.dumps({"prompt": QUESTION, "images": ["pics/gone.png"], "answer": "blue"})
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"prompts\.jsonl, row 2, image 1 \(.*pics/gone\.png\): not found$"):
        prepare_prompt_data(_config(tmp_path, path), tmp_path / "cache", logging.getLogger("test"))
    # on_bad_image: skip drops the row and counts it
    data = prepare_prompt_data(
        _config(tmp_path, path, on_bad_image="skip"), tmp_path / "cache", logging.getLogger("t")
    )
    assert len(data.train) == 2 and data.stats["skipped_bad_image"] == 1
    assert all("row 2" not in w for w in data.train["where"])


@pytest.fixture(scope="module")
def chat_tokenizer():
    return train_chat_tokenizer([f"{QUESTION} red green blue yellow purple orange"] * 20, vocab_size=300)


@pytest.mark.parametrize("family, model_config", [("qwen2_vl", TINY_QWEN2_VL), ("llava", TINY_LLAVA)])
def test_completion_log_probs_with_images_equal_a_plain_forward_of_each_row_alone(chat_tokenizer, family,
                                                                                  model_config):  # fmt: skip
    """Two prompts with pictures of different sizes, 3 sampled completions each (a group shares its prompt's
    picture); every completion token's log-prob at temperature 0.7 from the padded batch of 6 rows equals that of
    one forward of the row's prompt + completion, unpadded, with its own picture alone. float32: the two differ
    only by the order of the sums in batched vs single matmuls (~1e-6 on log-probs of size ~6), so atol 1e-5."""
    processor = tiny_processor(model_config, chat_tokenizer, max_image_pixels=12544)
    torch.manual_seed(0)
    model = build_vision_lm(processor, model_config=model_config).eval()
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((56, 56), (84, 112))]
    prompt_ids = []
    for picture in pictures:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids.append(list(processor(text=[text], images=[picture])["input_ids"][0]))
    G = 3
    repeated = [p for p in prompt_ids for _ in range(G)]
    pixels = dict(processor.image_processor(images=[p for p in pictures for _ in range(G)], return_tensors="pt"))
    images = PromptImages(pixels, processor)
    completions = sample_completions(
        model, repeated, list(range(len(repeated))), pad_token_id=processor.tokenizer.pad_token_id,
        eos_token_id=processor.tokenizer.eos_token_id, max_new_tokens=5, temperature=0.7, top_p=1.0, device="cpu",
        images=images,
    )  # fmt: skip
    assert not any(set(c) & set(images.suppressed_tokens()) for c in completions)
    rows = rollout_rows(repeated, completions, processor.tokenizer.pad_token_id, "cpu")
    rollouts = Rollouts(*rows, torch.zeros(len(repeated)), None, None, images.inputs(rows[0]))
    with torch.no_grad():
        log_probs, row_of = completion_log_probs(model, rollouts, temperature=0.7)
        expected = []
        for i, (prompt, completion) in enumerate(zip(repeated, completions)):
            ids = torch.tensor([prompt + completion])
            alone = dict(processor.image_processor(images=[pictures[i // G]], return_tensors="pt"))
            if "mm_token_type_ids" in processor.model_input_names:
                alone["mm_token_type_ids"] = torch.tensor(processor.create_mm_token_type_ids(ids.tolist()))
            logits = model(input_ids=ids, **alone).logits[0].float() / 0.7
            steps = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
            expected.append(steps.gather(-1, torch.tensor(completion)[:, None])[:, 0])
    assert row_of.tolist() == [i for i, c in enumerate(completions) for _ in c]
    torch.testing.assert_close(log_probs, torch.cat(expected), rtol=0, atol=1e-5)
    # Without the images the same tokens score otherwise: the images do reach the log-probs
    blind = Rollouts(*rows, torch.zeros(len(repeated)), None, None, None)
    with torch.no_grad():
        assert not torch.allclose(completion_log_probs(model, blind, temperature=0.7)[0], log_probs, atol=1e-3)


def test_rollouts_with_images_survive_a_checkpoint(tmp_path):
    """A checkpoint between the updates of one generation batch keeps its rollouts' image inputs, dtypes included."""
    image_inputs = {"pixel_values": torch.randn(4, 6), "image_grid_thw": torch.tensor([[1, 2, 2]]),
                    "mm_token_type_ids": torch.tensor([[0, 1, 1, 0]])}  # fmt: skip
    r = Rollouts(torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long),
                 torch.tensor([[-100, -100, -100, 3]]), torch.tensor([1]), torch.tensor([0.5]), None, None,
                 image_inputs)  # fmt: skip
    state = json.loads(json.dumps(r.state_dict()))  # as the checkpoint's JSON holds it
    back = Rollouts.from_state_dict(state, "cpu")
    for key, value in image_inputs.items():
        assert back.image_inputs[key].dtype == value.dtype and torch.equal(back.image_inputs[key], value)
    assert torch.equal(back.labels, r.labels)


def test_a_text_batch_has_no_prompt_images():
    assert prompt_images({"prompt_ids": [[1]]}, None) is None


def test_the_shapes_prompts_name_their_picture_and_colour(tmp_path):
    from tunebook.data.synthetic import SHAPE_COLOURS
    from tunebook.rl.vision_prompts import write_synthetic_image_prompts

    train, held = write_synthetic_image_prompts(tmp_path, 12, 4, seed=1)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(rows) == 12 and len(held.read_text().splitlines()) == 4
    for row in rows:
        assert row["prompt"][0]["content"][0] == {"type": "image"} and row["answer"] in SHAPE_COLOURS
        image = open_image({"path": str(train.parent / row["images"][0]), "bytes": None})
        assert SHAPE_COLOURS[row["answer"]] in {colour for _, colour in image.getcolors(1 << 16)}
