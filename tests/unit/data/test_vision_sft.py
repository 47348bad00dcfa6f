"""Vision-language SFT data: the loss mask of a conversation with images (both kinds of family: Qwen-VL's dynamic
image tokens, LLaVA's fixed ones), blank images expanding to the real images' token counts, a template whose
prefixes are not prefixes, rows cut inside an image, the cache key following an image's size, and the collator's
pixel values and its check of the image tokens."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from tunebook.config import SFTConfig
from tunebook.config.tiny import TINY_LLAVA, TINY_QWEN2_VL
from tunebook.data.image_files import image_reference, image_size, open_image
from tunebook.data.loaders import LengthGroupedSampler
from tunebook.data.packing import example_lengths
from tunebook.data.tokenize import IGNORE_INDEX
from tunebook.data.vision_collate import VisionCollator, VisionPackedCollator, VisionPromptCollator
from tunebook.data.vision_sft import prepare_sft_or_vision_data, prepare_vision_sft_data, uses_images
from tunebook.data.vision_tokenize import image_token_ids, tokenize_image_conversation, tokenize_image_conversations
from tunebook.errors import ConfigError, DataError
from tunebook.models.tokenizer import train_chat_tokenizer
from tunebook.models.vision import tiny_processor

CONFIGS = {"qwen2_vl": TINY_QWEN2_VL, "llava": TINY_LLAVA}
LOG = logging.getLogger("test")


@pytest.fixture(scope="module")
def processors():
    texts = ["user\nwhat colour is the square? which shape is red?", "assistant\nred green blue square circle"] * 10
    tokenizer = train_chat_tokenizer(texts, vocab_size=300)
    return {family: tiny_processor(config, tokenizer) for family, config in CONFIGS.items()}


def _conversation():
    return [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the square?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        {"role": "user", "content": [{"type": "text", "text": "and this one?"}, {"type": "image"}]},
        {"role": "assistant", "content": "blue"},
    ]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_only_assistant_turns_and_their_end_of_turn_carry_loss(processors, family):
    processor = processors[family]
    tokenizer = processor.tokenizer
    ids, labels, prompt_length = tokenize_image_conversation(processor, _conversation(), [[56, 56], [84, 56]])
    images = image_token_ids(processor)
    # Qwen-VL: one per 28 x 28 pixels, the 84 x 56 picture resized within 64 x 64 pixels first; LLaVA: always 4.
    assert sum(t in images for t in ids) == {"qwen2_vl": 4 + 2, "llava": 4 + 4}[family]
    assert all(label == IGNORE_INDEX for t, label in zip(ids, labels) if t in images)  # never an image token
    labelled = [t for t in labels if t != IGNORE_INDEX]
    assert tokenizer.decode(labelled) == "red<|im_end|>\nblue<|im_end|>\n"  # the answers and their end of turn
    # What carries no loss: the system and user turns (their text, and images), the generation prompts.
    masked = tokenizer.decode([t for t, label in zip(ids, labels) if label == IGNORE_INDEX and t not in images])
    assert "what colour is the square?" in masked and "and this one?" in masked and "Answer in one word." in masked
    assert masked.count("<|im_start|>assistant\n") == 2
    # The prompt of generation evaluation: everything before the last answer, its generation prompt included.
    prompt = tokenizer.decode(ids[:prompt_length])
    assert "and this one?" in prompt and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("family", list(CONFIGS))
def test_blank_images_expand_to_the_real_images_token_counts(processors, family, tmp_path):
    processor = processors[family]
    generator = torch.Generator().manual_seed(0)
    for width, height in [[56, 56], [84, 56], [112, 84], [100, 70], [30, 200], [640, 480]]:
        pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(tmp_path / "real.png")
        reference = image_reference(str(tmp_path / "real.png"))
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which shape is red?"}]},
            {"role": "assistant", "content": "square"},
        ]
        # Preparation: the size from the header, blank images; training: the decoded file.
        ids, _, _ = tokenize_image_conversation(processor, messages, [list(image_size(reference))])
        text = processor.apply_chat_template(messages, tokenize=False)
        assert ids == list(processor(text=[text], images=[open_image(reference)])["input_ids"][0]), (width, height)


def test_a_template_whose_prefixes_are_not_prefixes_is_one_line(processors):
    processor = processors["qwen2_vl"]
    processor.chat_template, template = (
        processor.chat_template.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'"),
        processor.chat_template,
    )
    try:
        with pytest.raises(DataError) as error:
            tokenize_image_conversation(processor, _conversation(), [[56, 56], [84, 56]])
    finally:
        processor.chat_template = template
    assert "\n" not in str(error.value).strip()
    assert "renders the conversation differently around message 3 (assistant)" in str(error.value)


def test_a_cut_inside_an_image_drops_the_row_and_counts_it(processors):
    processor = processors["qwen2_vl"]
    row = {"messages": _conversation(), "where": "data.jsonl, row 7"}
    batch = {"conversation": [json.dumps(row)] * 2, "image_sizes": [[[56, 56], [84, 56]]] * 2}
    full, _, _ = tokenize_image_conversation(processor, _conversation(), [[56, 56], [84, 56]])
    last_image_token = max(i for i, t in enumerate(full) if t in image_token_ids(processor))
    out = tokenize_image_conversations(batch, processor=processor, max_seq_length=last_image_token,
                                       overlong="truncate", assistant_only_loss=True)  # fmt: skip
    assert out["image_cut"] == [True, True] and out["keep"] == [False, False]
    out = tokenize_image_conversations(batch, processor=processor, max_seq_length=len(full) - 1,
                                       overlong="truncate", assistant_only_loss=True)  # fmt: skip
    assert out["image_cut"] == [False, False] and out["truncated"] == [True, True] and out["keep"] == [True, True]


def _write_data(tmp_path, sizes):
    (tmp_path / "images").mkdir(exist_ok=True)
    rows = []
    for i, (width, height) in enumerate(sizes):
        Image.new("RGB", (width, height), (200, 30 * i, 40)).save(tmp_path / "images" / f"{i}.png")
        question = [{"type": "image"}, {"type": "text", "text": "colour?"}]
        rows.append({"messages": [{"role": "user", "content": question},
                                  {"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
                     "images": [f"images/{i}.png"]})  # fmt: skip
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path, **keys):
    return SFTConfig(train_data=str(tmp_path / "train.jsonl"), model_config=dict(TINY_QWEN2_VL),
                     cache_dir=str(tmp_path / "cache"), tokenizer_vocab_size=300, **keys)  # fmt: skip


def test_the_cache_key_follows_an_image_files_size(tmp_path):
    _write_data(tmp_path, [(56, 56), (56, 56), (84, 56)])
    first = prepare_vision_sft_data(_config(tmp_path), tmp_path / "cache", LOG)
    again = prepare_vision_sft_data(_config(tmp_path), tmp_path / "cache", LOG)
    assert "train tokenisation" in first.built and "train tokenisation" not in again.built  # cached
    assert first.train[0]["images"] == [{"path": str(tmp_path / "images" / "0.png"), "bytes": None}]  # not pixels
    assert first.train[0]["image_sizes"] == [[56, 56]]
    Image.new("RGB", (28, 28), (0, 0, 0)).save(tmp_path / "images" / "0.png")  # the same file, another size
    changed = prepare_vision_sft_data(_config(tmp_path), tmp_path / "cache", LOG)
    assert "train tokenisation" in changed.built
    image_pad = changed.processor.image_token_id
    assert first.train[0]["input_ids"].count(image_pad) == 4
    assert changed.train[0]["input_ids"].count(image_pad) == 1  # one 28 x 28 patch group
    assert changed.train[0]["image_sizes"] == [[28, 28]]


def test_packed_rows_keep_each_examples_images_in_the_order_of_their_placeholders(tmp_path):
    _write_data(tmp_path, [(56, 56), (28, 28), (84, 56), (56, 28), (28, 28), (56, 56)])
    data = prepare_vision_sft_data(_config(tmp_path, packing=True, max_seq_length=64), tmp_path / "cache", LOG)
    examples = prepare_vision_sft_data(_config(tmp_path), tmp_path / "cache", LOG).train
    assert "train packing" in data.built and data.stats["examples_packed"] == len(examples) == 6
    assert len(data.train) < len(examples)
    by_where = {e["where"]: e for e in examples}
    image_pad, seen = data.processor.image_token_id, []
    for row in data.train:
        assert len(row["input_ids"]) <= 64 and sum(row["images_per_example"]) == len(row["images"])
        start, image = 0, 0
        wheres = row["where"].split("; ")  # the examples' rows, in the packed row's order
        for length, count, where in zip(row["seq_lengths"], row["images_per_example"], wheres, strict=True):
            example = by_where[where]
            assert row["input_ids"][start : start + length] == example["input_ids"]  # the example, whole
            assert row["images"][image : image + count] == example["images"]  # its images, in its place
            seen.append(where)
            start, image = start + length, image + count
    assert sorted(seen) == sorted(examples["where"])
    # The collator decodes them in that order: every row's image tokens are as many as its images need (it checks).
    batch = VisionPackedCollator(data.processor, _tiny_qwen_config())(list(data.train))
    needed = (batch["image_grid_thw"].prod(-1) // 4).sum().item()
    assert (batch["input_ids"] == image_pad).sum().item() == needed
    assert batch["pixel_values"].shape[0] == batch["image_grid_thw"].prod(-1).sum().item()


def _tiny_qwen_config():
    from transformers import AutoConfig

    values = {k: v for k, v in TINY_QWEN2_VL.items() if k != "model_type"}
    return AutoConfig.for_model("qwen2_vl", **values)


def test_length_grouping_counts_the_image_tokens(tmp_path):
    # The same text, pictures of 1 and of 16 image tokens (28 x 28 pixels each, within max_pixels 112 x 112).
    _write_data(tmp_path, [(28, 28), (112, 112)] * 4)
    data = prepare_vision_sft_data(_config(tmp_path, max_pixels=112 * 112), tmp_path / "cache", LOG)
    lengths = example_lengths(data.train)  # what recipes/sft.py gives the sampler with group_by_length
    image_pad = data.processor.image_token_id
    tokens = [row["input_ids"].count(image_pad) for row in data.train]
    assert sorted(set(tokens)) == [1, 16]
    assert lengths.tolist() == [len(row["input_ids"]) for row in data.train]  # the expanded length
    assert len(set(lengths - np.array(tokens))) == 1  # the text alone is the same length in every row
    order = list(LengthGroupedSampler(lengths, batch_size=4, seed=0))
    for batch in (order[:4], order[4:]):  # each batch holds pictures of one size: it pads nothing
        assert len({int(lengths[i]) for i in batch}) == 1


def test_the_collator_decodes_the_images_and_checks_their_tokens(tmp_path, processors):
    processor = processors["qwen2_vl"]
    Image.new("RGB", (56, 56), (255, 0, 0)).save(tmp_path / "a.png")
    Image.new("RGB", (56, 28), (0, 0, 255)).save(tmp_path / "b.png")
    features = []
    for name, size in (("a.png", [56, 56]), ("b.png", [56, 28])):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]},
                    {"role": "assistant", "content": "red"}]  # fmt: skip
        ids, labels, prompt_length = tokenize_image_conversation(processor, messages, [size])
        reference = image_reference(str(tmp_path / name))
        features.append({"input_ids": ids, "labels": labels, "prompt_length": prompt_length, "images": [reference],
                         "where": f"train.jsonl, row {name}"})  # fmt: skip
    batch = VisionCollator(processor)(features)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4]]  # 2 x 2 and 1 x 2 image tokens' patches
    assert batch["pixel_values"].shape[0] == 16 + 8
    assert batch["mm_token_type_ids"].sum().item() == 4 + 2
    prompts = VisionPromptCollator(processor)(features)
    for row in prompts["input_ids"]:  # left-padded prompts ending in the generation prompt
        assert processor.tokenizer.decode(row).endswith("colour?<|im_end|>\n<|im_start|>assistant\n")
    assert prompts["image_grid_thw"].shape == (2, 3)
    Image.new("RGB", (28, 28)).save(tmp_path / "b.png")  # replaced after preparation by one of another size
    with pytest.raises(
        DataError, match=r"train.jsonl, row b.png: 2 image tokens in the row, but its images \(28x28\) need 1"
    ):
        VisionCollator(processor)(features)


def test_the_config_default_of_max_image_pixels_is_the_data_codes():
    from tunebook.config.vision import DEFAULT_MAX_IMAGE_PIXELS
    from tunebook.data.image_files import DEFAULT_MAX_IMAGE_PIXELS as DATA_DEFAULT

    assert DEFAULT_MAX_IMAGE_PIXELS == DATA_DEFAULT == SFTConfig().max_image_pixels


def test_images_for_a_text_model_are_one_line(tmp_path):
    _write_data(tmp_path, [(56, 56)])
    tiny_llama = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1}  # a text model, named
    config = SFTConfig(train_data=str(tmp_path / "train.jsonl"), cache_dir=str(tmp_path / "cache"),
                       model_config=tiny_llama)  # fmt: skip
    with pytest.raises(ConfigError, match=r"has images \(column 'images'\), and model_config \(llama\) is not a "):
        uses_images(config)
    assert uses_images(_config(tmp_path))


def test_images_and_no_model_named_build_a_tiny_qwen2_vl(tmp_path, caplog):
    _write_data(tmp_path, [(56, 56), (84, 56)])
    config = SFTConfig(train_data=str(tmp_path / "train.jsonl"), cache_dir=str(tmp_path / "cache"))  # no model
    with caplog.at_level(logging.INFO, logger="test"):
        data = prepare_sft_or_vision_data(config, tmp_path / "cache", LOG)
    assert config.model_config == TINY_QWEN2_VL and "has images and no model is named" in caplog.text
    assert type(data.processor).__name__ == "Qwen2VLProcessor" and len(data.train) == 2


def test_cached_pixel_values_equal_decoded_ones_and_follow_a_rewritten_file(tmp_path):
    _write_data(tmp_path, [(56, 56), (84, 56), (56, 84)])
    decoded = prepare_vision_sft_data(_config(tmp_path), tmp_path / "cache", LOG)
    cached = prepare_vision_sft_data(_config(tmp_path, cache_pixel_values=True), tmp_path / "cache", LOG)
    assert "pixel_inputs" not in decoded.train.column_names and "train tokenisation" in cached.built
    rows = lambda data: [data.train[i] for i in range(len(data.train))]  # noqa: E731
    from_files = VisionCollator(decoded.processor)(rows(decoded))
    from_cache = VisionCollator(cached.processor)(rows(cached))
    assert from_files.keys() == from_cache.keys()
    for name, value in from_files.items():  # bit for bit: float32 pixels stored as float32
        assert torch.equal(value, from_cache[name]), name
    # The cache holds what the file's pixels were: a file rewritten at the same size is decoded again.
    Image.new("RGB", (56, 56), (0, 0, 255)).save(tmp_path / "images" / "0.png")
    again = prepare_vision_sft_data(_config(tmp_path, cache_pixel_values=True), tmp_path / "cache", LOG)
    assert "train tokenisation" in again.built
    fresh = VisionCollator(again.processor)(rows(again))["pixel_values"]
    assert not torch.equal(fresh, from_cache["pixel_values"])
    assert torch.equal(fresh, VisionCollator(decoded.processor)(rows(decoded))["pixel_values"])  # the new pixels


def test_packed_rows_carry_their_cached_pixel_values(tmp_path):
    from transformers import AutoConfig

    _write_data(tmp_path, [(56, 56), (84, 56), (56, 84), (112, 84)])
    model_config = AutoConfig.for_model(**TINY_QWEN2_VL)
    batches = []
    for cache in (False, True):
        data = prepare_vision_sft_data(_config(tmp_path, packing=True, cache_pixel_values=cache), tmp_path / "cache",
                                       LOG)  # fmt: skip
        assert ("pixel_inputs" in data.train.column_names) == cache
        rows = [data.train[i] for i in range(len(data.train))]
        batches.append(VisionPackedCollator(data.processor, model_config)(rows))
    assert batches[0].keys() == batches[1].keys()
    for name, value in batches[0].items():  # the packed rows' pixels as decoding them gives
        assert torch.equal(value, batches[1][name]), name
