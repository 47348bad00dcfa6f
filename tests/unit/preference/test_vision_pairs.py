"""Preference pairs with images (DPO of a vision-language model): the forms of TRL's vision DPO data read alike, the
chosen and rejected sequences share the prompt's tokens (its image tokens included) and only the responses carry
labels; a batch of pairs gives the same log-probabilities as each sequence scored alone with its image by the
processor and the model; the reference's precomputed log-probabilities see the images; bad input is one line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import datasets
import pytest
import torch
from PIL import Image

from tunebook.config import DPOConfig
from tunebook.config.tiny import TINY_LLAVA, TINY_QWEN2_VL
from tunebook.data.image_files import open_image
from tunebook.data.images import check_images, read_image_source
from tunebook.data.sources import DataSource
from tunebook.data.synthetic import SHAPE_COLOURS, write_synthetic_image_preferences, write_synthetic_image_task
from tunebook.data.vision_collate import VisionPairCollator
from tunebook.errors import ConfigError, DataError
from tunebook.models.tokenizer import train_chat_tokenizer
from tunebook.models.vision import build_vision_lm, tiny_processor
from tunebook.preference import (
    precompute_reference_log_probs,
    prepare_preference_or_vision_data,
    sequence_log_probs,
)
from tunebook.preference.vision_data import PAIR_IMAGE_FEATURES, parse_image_pair, tokenize_image_pairs

CONFIGS = {"qwen2_vl": TINY_QWEN2_VL, "llava": TINY_LLAVA}  # dynamic image tokens, and a fixed count
QUESTION = "What colour is the square?"


@pytest.fixture(scope="module")
def processors():
    tokenizer = train_chat_tokenizer([f"{QUESTION} red blue green, a square on a field."] * 20, vocab_size=300)
    return {family: tiny_processor(config, tokenizer) for family, config in CONFIGS.items()}


@pytest.fixture
def folder(tmp_path) -> Path:
    (tmp_path / "images").mkdir()
    Image.new("RGB", (56, 56), "red").save(tmp_path / "images" / "a.png")
    Image.new("RGB", (84, 56), (40, 80, 220)).save(tmp_path / "images" / "b.png")
    return tmp_path


def _pairs(folder: Path, rows: list[dict]) -> datasets.Dataset:
    """Rows as the pipeline reads them: through `read_image_source` and `check_images`."""
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = DataSource(str(path))
    read = read_image_source(source, folder / "cache", 0, data_format="pairs", parse=parse_image_pair)
    return check_images(read).dataset


def _tokenised(folder, rows, processor, max_seq_length=512):
    checked = _pairs(folder, rows)
    out = tokenize_image_pairs(checked[:], processor=processor, max_seq_length=max_seq_length, overlong="truncate")
    return checked, out


USER = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}


def _answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


FORMS = {  # one pair, written each way TRL's vision DPO data is
    "messages": {"prompt": [USER], "chosen": _answer("red"), "rejected": _answer("blue"), "images": ["images/a.png"]},
    "strings": {"prompt": QUESTION, "chosen": "red", "rejected": "blue", "images": ["images/a.png"]},
    "implicit": {"chosen": [USER, *_answer("red")], "rejected": [USER, *_answer("blue")], "images": ["images/a.png"]},
    "inline": {"prompt": [{"role": "user", "content": [{"type": "image", "image": "images/a.png"},
                                                       {"type": "text", "text": QUESTION}]}],
               "chosen": "red", "rejected": "blue"},
}  # fmt: skip


@pytest.mark.parametrize("family", list(CONFIGS))
def test_every_form_gives_the_same_tokens_and_only_the_responses_carry_labels(folder, processors, family):
    processor = processors[family]
    _, out = _tokenised(folder, list(FORMS.values()), processor)
    for key in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"):
        assert all(row == out[key][0] for row in out[key]), key  # the four forms read alike
    chosen, rejected = out["chosen_input_ids"][0], out["rejected_input_ids"][0]
    prompt = out["chosen_labels"][0].count(-100)
    assert out["rejected_labels"][0].count(-100) == prompt
    assert chosen[:prompt] == rejected[:prompt]  # the same prompt tokens, its images' included
    image_tokens = [i for i, t in enumerate(chosen) if t == processor.image_token_id]
    assert len(image_tokens) == 4 and max(image_tokens) < prompt  # 56 x 56: 2 x 2 tokens in both families
    for ids, labels, answer in (
        (chosen, out["chosen_labels"][0], "red"),
        (rejected, out["rejected_labels"][0], "blue"),
    ):
        assert all(label == -100 for label in labels[:prompt]) and labels[prompt:] == ids[prompt:]
        assert processor.tokenizer.decode(ids[prompt:]).startswith(answer + "<|im_end|>")
    # Exactly what the processor makes of the prompt alone with the generation prompt, and of the whole pair.
    image = open_image({"path": str(folder / "images" / "a.png"), "bytes": None})
    text = processor.apply_chat_template([USER], tokenize=False, add_generation_prompt=True)
    assert list(processor(text=[text], images=[image])["input_ids"][0]) == chosen[:prompt]


def test_a_cut_keeps_the_prompt_and_its_images_whole(folder, processors):
    processor = processors["qwen2_vl"]
    _, full = _tokenised(folder, [FORMS["messages"]], processor)
    prompt = full["chosen_labels"][0].count(-100)
    _, cut = _tokenised(folder, [FORMS["messages"]], processor, max_seq_length=prompt + 1)
    assert cut["keep"] == [True] and cut["truncated"] == [True]
    assert cut["chosen_input_ids"][0] == full["chosen_input_ids"][0][: prompt + 1]
    _, short = _tokenised(folder, [FORMS["messages"]], processor, max_seq_length=prompt)
    assert short["keep"] == [False]  # no room for a response: dropped, never an image cut


def test_bad_pairs_are_one_line_naming_the_file_row_and_image(folder):
    missing = {**FORMS["messages"], "images": ["images/gone.png"]}
    with pytest.raises(DataError) as error:
        _pairs(folder, [FORMS["messages"], missing])
    line = str(error.value)
    assert "\n" not in line and "pairs.jsonl, row 2, image 1" in line and "gone.png" in line, line
    in_response = {**FORMS["messages"], "chosen": [{"role": "assistant", "content": [{"type": "image"}]}],
                   "images": ["images/a.png", "images/b.png"]}  # fmt: skip
    with pytest.raises(DataError, match=r"row 1: an image in the chosen or rejected response"):
        _pairs(folder, [in_response])
    with pytest.raises(DataError, match=r"row 1: 1 image placeholders but 2 images in column 'images'"):
        _pairs(folder, [{**FORMS["messages"], "images": ["images/a.png", "images/b.png"]}])


def _pair_rows(folder):
    """Two pairs with pictures of different sizes (6 and 4 image tokens in Qwen2-VL) and responses of different
    lengths, so the batch pads."""
    second = {"prompt": [USER], "chosen": "blue, a square", "rejected": "red", "images": ["images/b.png"]}
    return [FORMS["messages"], second]


def _alone(model, processor, folder, row: dict, side: str) -> torch.Tensor:
    """The plain computation: one sequence scored alone with its image, straight from the processor and the
    model's full logits: the summed log-probabilities of the tokens after the prompt."""
    image = open_image({"path": str(folder / row["images"][0]), "bytes": None})
    prompt = row["prompt"]
    response = row[side] if isinstance(row[side], list) else _answer(row[side])
    prompt_text = processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    full = processor(text=[processor.apply_chat_template(prompt + response, tokenize=False)], images=[image],
                     return_tensors="pt")  # fmt: skip
    start = len(processor(text=[prompt_text], images=[image])["input_ids"][0])
    logits = model(**full).logits[0].float()
    ids = full["input_ids"][0]
    log_probs = torch.log_softmax(logits[start - 1 : -1], dim=-1)
    return log_probs.gather(1, ids[start:, None]).sum()


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_batch_of_pairs_scores_each_sequence_as_it_scores_alone_with_its_image(folder, processors, family):
    processor = processors[family]
    torch.manual_seed(0)
    model = build_vision_lm(processor, model_config=CONFIGS[family]).eval()
    checked, out = _tokenised(folder, _pair_rows(folder), processor)
    features = [{**{k: out[k][i] for k in out}, "images": checked[i]["images"]} for i in range(2)]
    batch = VisionPairCollator(processor)(features)
    assert batch["input_ids"].shape[0] == 4 and batch["attention_mask"].sum(1).unique().numel() > 1  # padded
    with torch.no_grad():
        batched = sequence_log_probs(model, batch)
        alone = torch.stack([_alone(model, processor, folder, row, side) for side in ("chosen", "rejected")
                             for row in _pair_rows(folder)])  # fmt: skip
    # float32: batching and padding change only the order of float32 reductions (~1e-6 relative each), so the
    # summed log-probabilities (about 6 a token here) agree to 1e-5 relative.
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    # The reference's precomputed log-probabilities go through the same collator: the images are seen.
    dataset = datasets.Dataset.from_list(features, features=_features_of(features))
    with_ref, _ = precompute_reference_log_probs(model, dataset, VisionPairCollator(processor), "cpu",
                                                 folder / "ref", "k", 2, "sdpa")  # fmt: skip
    torch.testing.assert_close(torch.tensor(with_ref["ref_chosen_logps"]), batched[:2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(with_ref["ref_rejected_logps"]), batched[2:], rtol=1e-5, atol=1e-5)


def _features_of(features):
    return datasets.Features({k: PAIR_IMAGE_FEATURES[k] for k in features[0]})


def test_the_shapes_pairs_are_the_shapes_tasks_pictures_with_a_wrong_colour_rejected(tmp_path):
    train, evaluation = write_synthetic_image_preferences(tmp_path, 30, 6, seed=3)
    task_train, _ = write_synthetic_image_task(tmp_path, 30, 6, seed=3)
    assert train.parent == task_train.parent and evaluation.name == "pairs-eval.jsonl"
    pairs = [json.loads(line) for line in train.read_text().splitlines()]
    examples = [json.loads(line) for line in task_train.read_text().splitlines()]
    assert len(pairs) == 30 and [p["images"] for p in pairs] == [e["images"] for e in examples]
    for pair, example in zip(pairs, examples):
        assert pair["prompt"] == example["messages"][:1] and pair["chosen"] == example["messages"][1:]
        wrong = pair["rejected"][0]["content"][0]["text"]
        assert wrong in SHAPE_COLOURS and wrong != pair["chosen"][0]["content"][0]["text"]
    assert len({p["rejected"][0]["content"][0]["text"] for p in pairs}) > 2
    assert write_synthetic_image_preferences(tmp_path, 30, 6, seed=3) == (train, evaluation)  # reused as written


def test_image_pairs_with_a_text_model_are_one_config_line(folder):
    path = folder / "pairs.jsonl"
    path.write_text(json.dumps(FORMS["messages"]) + "\n")
    text_model = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1}  # named: a text model
    config = DPOConfig(train_data=str(path), model_config=text_model)
    with pytest.raises(ConfigError) as error:
        prepare_preference_or_vision_data(config, folder / "cache", logging.getLogger("test"))
    line = str(error.value)
    assert "\n" not in line and "pairs.jsonl has images (column 'images')" in line and "not a vision-language" in line
    no_model = DPOConfig(train_data=str(path))  # no model named: the tiny default becomes a Qwen2-VL
    data = prepare_preference_or_vision_data(no_model, folder / "cache", logging.getLogger("test"))
    assert no_model.model_config["model_type"] == "qwen2_vl" and data.processor is not None
