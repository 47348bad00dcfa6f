"""Vision-language models: tiny Qwen-VL and LLaVA models and their processors built offline, a forward and backward
on two images of different sizes, the assistant mask of their templates, freezing, LoRA targets, the saved folder's
round trip, and the transformers behaviours the Qwen-VL workarounds exist for (each fails once it is fixed)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, PretrainedConfig

from tunebook.config.tiny import TINY_LLAMA, TINY_LLAVA, TINY_QWEN2_5_VL, TINY_QWEN2_VL
from tunebook.data.tokenize import assistant_spans
from tunebook.errors import ConfigError, ModelError
from tunebook.models.build import build_causal_lm
from tunebook.models.fused_cpu import set_fused_cpu_layers
from tunebook.models.tokenizer import setup_chat_template, train_chat_tokenizer
from tunebook.models.vision import (
    build_vision_lm,
    freeze_vision,
    is_vision_language_model,
    load_processor,
    lora_targets,
    save_processor,
    tiny_processor,
    vision_modules,
)

CONFIGS = {"qwen2_vl": TINY_QWEN2_VL, "qwen2_5_vl": TINY_QWEN2_5_VL, "llava": TINY_LLAVA}
# Image tokens of a 28 x 56 and a 56 x 56 picture: Qwen-VL one per 28 x 28 pixels, LLaVA always the tower's 2 x 2.
IMAGE_TOKENS = {"qwen2_vl": [2, 4], "qwen2_5_vl": [2, 4], "llava": [4, 4]}
ROUND_TRIP = ["qwen2_vl", "llava"]  # one family of each kind: dynamic and fixed image tokens


@pytest.fixture(scope="module")
def chat_tokenizer():
    texts = ["what is in the picture? a red square on a blue field, and two green circles."] * 20
    return train_chat_tokenizer(texts, vocab_size=300)


@pytest.fixture(scope="module")
def processors(chat_tokenizer):
    return {family: tiny_processor(config, chat_tokenizer) for family, config in CONFIGS.items()}


def _model(processor, family):
    torch.manual_seed(0)
    return build_vision_lm(processor, model_config=CONFIGS[family])


def _images():
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((28, 56), (56, 56))]


def _conversation(answer: str) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in the picture?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        {"role": "user", "content": "and the circles?"},
        {"role": "assistant", "content": "two green circles."},
    ]


def _batch(processor):
    texts = [processor.apply_chat_template(_conversation(a), tokenize=False) for a in ("a red square", "a blue field")]
    batch = processor(images=[[image] for image in _images()], text=texts, padding=True, return_tensors="pt")
    keep = (batch["attention_mask"] == 1) & (batch["input_ids"] != processor.image_token_id)
    batch["labels"] = batch["input_ids"].masked_fill(~keep, -100)
    return batch


@pytest.mark.parametrize("family", list(CONFIGS))
def test_forward_and_backward_on_two_images_of_different_sizes(processors, family):
    processor = processors[family]
    model = _model(processor, family)
    frozen = freeze_vision(model)
    batch = _batch(processor)
    assert (batch["input_ids"] == processor.image_token_id).sum(dim=1).tolist() == IMAGE_TOKENS[family]
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    towers, projectors = vision_modules(model)
    assert frozen == towers
    for name, parameter in model.named_parameters():
        in_projector = any(name.startswith(p + ".") for p in projectors)
        in_tower = any(name.startswith(t + ".") for t in towers) and not in_projector
        assert parameter.requires_grad is not in_tower, name
        if not in_tower and "embed_tokens" not in name and "lm_head" not in name:
            assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name


@pytest.mark.parametrize("family", ROUND_TRIP)
def test_gradient_checkpointing_gives_the_same_gradients_with_the_tower_frozen(processors, family):
    batch = _batch(processors[family])
    gradients = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_vision_lm(processors[family], model_config=CONFIGS[family], gradient_checkpointing=checkpointing)
        freeze_vision(model)
        model.train()
        model(**batch).loss.backward()
        gradients.append({name: p.grad for name, p in model.named_parameters() if p.requires_grad})
        assert model.config.get_text_config().use_cache is not checkpointing
    assert gradients[0].keys() == gradients[1].keys()
    for name, gradient in gradients[0].items():
        assert torch.allclose(gradient, gradients[1][name], atol=1e-6), name


# Other families, built from transformers' configs shrunk (no processor): their vision parts are found by name.
TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128}  # fmt: skip
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
          "image_size": 28, "patch_size": 14}  # fmt: skip
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
OTHER_FAMILIES = {
    "idefics3": ({"text_config": {"model_type": "llama", **TEXT}, "vision_config": VISION, "scale_factor": 2},
                 ["model.vision_model"], ["model.connector"]),
    "smolvlm": ({"text_config": {"model_type": "llama", **TEXT}, "vision_config": VISION, "scale_factor": 2},
                ["model.vision_model"], ["model.connector"]),
    "gemma3": ({"text_config": {"model_type": "gemma3_text", "head_dim": 16, **TEXT}, "vision_config": VISION,
                "mm_tokens_per_image": 4}, ["model.vision_tower"], ["model.multi_modal_projector"]),
    "qwen3_vl": ({"text_config": {"head_dim": 16, "rope_parameters": MROPE, **TEXT},
                  "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                    "out_hidden_size": 64, "deepstack_visual_indexes": [0],
                                    "num_position_embeddings": 16}},
                 ["model.visual"], ["model.visual.merger", "model.visual.deepstack_merger_list"]),
}  # fmt: skip


@pytest.mark.parametrize("family", list(OTHER_FAMILIES))
def test_the_vision_parts_of_other_families_are_found_by_their_names(family):
    from transformers import AutoConfig

    values, towers, projectors = OTHER_FAMILIES[family]
    assert is_vision_language_model({"model_type": family})
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(family, **values))
    assert vision_modules(model) == (towers, projectors)
    freeze_vision(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(name.startswith(tuple(towers)) for name in frozen)
    assert not any(name.startswith(tuple(projectors)) for name in frozen)
    targets = re.compile(lora_targets(model, projector=True))
    adapted = [name for name, _ in model.named_modules() if targets.fullmatch(name)]
    assert len([name for name in adapted if not name.startswith(tuple(projectors))]) == 7  # the one layer's linears
    assert not [name for name in adapted if name.startswith(tuple(towers)) and not name.startswith(tuple(projectors))]


@pytest.mark.parametrize("family", ROUND_TRIP)
def test_the_template_renders_images_and_masks_the_assistant_turns_as_the_text_path_does(processors, family):
    processor, conversation = processors[family], _conversation("a red square")
    tokenizer = processor.tokenizer
    text, spans = assistant_spans(tokenizer, conversation)  # render and compare, as the text path masks
    assert processor.apply_chat_template(conversation, tokenize=False) == text
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>" if family != "llava" else "<image>\n"
    assert text.count(placeholder) == 1 and text.index(placeholder) < text.index("what is in the picture?")
    assert [text[a:b] for a, b in spans] == ["a red square<|im_end|>\n", "two green circles.<|im_end|>\n"]

    # The {% generation %} markers mask the same tokens.
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    by_spans = [int(any(a <= start < b for a, b in spans)) for start, _ in encoded["offset_mapping"]]
    marked = tokenizer.apply_chat_template(conversation, return_dict=True, return_assistant_tokens_mask=True)
    assert marked["input_ids"] == encoded["input_ids"]
    assert marked["assistant_masks"] == by_spans

    # The chat recipes' set-up keeps <|im_end|>, which ends an assistant turn, as the EOS the model learns to stop at.
    assert setup_chat_template(tokenizer, None, False, _NoLog()).eos_token == "<|im_end|>"


class _NoLog:
    def info(self, *args):
        pass


@pytest.mark.parametrize("family", ROUND_TRIP)
def test_freezing_the_projector_too_and_a_model_without_vision_parts(processors, family):
    model = _model(processors[family], family)
    towers, projectors = vision_modules(model)
    assert freeze_vision(model, vision_tower=False, projector=False) == []
    assert all(p.requires_grad for p in model.parameters())
    assert freeze_vision(model, vision_tower=False, projector=True) == projectors
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert not any(name.startswith(tuple(p + "." for p in projectors)) for name in trainable)
    assert any(name.startswith(tuple(t + "." for t in towers)) for name in trainable)  # the tower still trains
    assert any(".language_model." in name for name in trainable)

    llama = build_causal_lm(processors[family].tokenizer, model_config=TINY_LLAMA)
    with pytest.raises(ModelError, match="LlamaForCausalLM has no vision tower"):
        freeze_vision(llama)


@pytest.mark.parametrize("family", ROUND_TRIP)
def test_lora_adapts_the_language_model_and_with_it_the_projector_but_never_the_tower(processors, family):
    pytest.importorskip("peft")
    from tunebook.config import SFTConfig
    from tunebook.models.lora import apply_lora

    config = SFTConfig(use_peft=True, lora_r=2, lora_alpha=4, lora_dropout=0.0)
    for projector in (False, True):
        model = _model(processors[family], family)
        towers, projectors = vision_modules(model)
        model = apply_lora(model, config, target_modules=lora_targets(model, projector=projector))
        adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in model.named_parameters() if ".lora_A." in name}
        in_projector = {n for n in adapted if any(f"{p}." in n for p in projectors)}
        in_tower = {n for n in adapted if any(f"{t}." in n for t in towers)} - in_projector
        assert not in_tower
        assert bool(in_projector) is projector
        assert {n for n in adapted - in_projector if ".language_model." not in n} == set()
        assert len(adapted - in_projector) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers


@pytest.mark.parametrize("family", ROUND_TRIP)
def test_the_saved_folder_loads_with_the_auto_classes_and_gives_the_same_logits(tmp_path, processors, family):
    processor = processors[family]
    model = _model(processor, family).eval()
    model.save_pretrained(tmp_path)
    save_processor(processor, tmp_path)

    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    assert is_vision_language_model(str(tmp_path))
    if family == "llava":
        loaded_processor = AutoProcessor.from_pretrained(tmp_path)
    else:  # without torchvision a Qwen-VL folder loads only through load_processor (test below)
        loaded_processor = load_processor(str(tmp_path))
    assert type(loaded_processor) is type(processor)
    assert loaded_processor.chat_template == processor.chat_template
    assert loaded_processor.tokenizer.chat_template == processor.tokenizer.chat_template
    batch, loaded_batch = _batch(processor), _batch(loaded_processor)
    assert batch.keys() == loaded_batch.keys()
    for key in batch:
        assert torch.equal(batch[key], loaded_batch[key]), key
    with torch.no_grad():
        fused = model(**batch).logits  # the built model runs Llama's norms and rotary fused (to float32 rounding)
        set_fused_cpu_layers(model, False)
        assert torch.equal(model(**batch).logits, reloaded(**loaded_batch).logits)
        assert torch.allclose(fused, reloaded(**loaded_batch).logits, atol=1e-5)

    # The recipes' own loaders take it too.
    again = build_vision_lm(load_processor(str(tmp_path)), model_name_or_path=str(tmp_path))
    assert torch.equal(again.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert not any(key in (tmp_path / "tokenizer_config.json").read_text() for key in ("is_local", "local_files"))


def test_which_models_are_vision_language_models(tmp_path):
    for config in CONFIGS.values():
        assert is_vision_language_model(config)
    assert not is_vision_language_model(TINY_LLAMA)
    assert not is_vision_language_model({"model_type": "clip"})  # a vision_config, but no text generation
    assert is_vision_language_model(PretrainedConfig.from_dict({"auto_map": {"AutoModelForImageTextToText": "m.M"}}))
    path = tmp_path / "model.json"
    path.write_text(json.dumps(TINY_LLAVA))
    assert is_vision_language_model(str(path))
    with pytest.raises(ModelError, match="model path not found: ./missing"):
        is_vision_language_model("./missing")


def test_errors_a_user_can_cause(tmp_path, chat_tokenizer, processors):
    with pytest.raises(ConfigError, match="no tiny processor for model_type 'llama'"):
        tiny_processor(TINY_LLAMA, chat_tokenizer)
    with pytest.raises(ConfigError, match="needs model_name_or_path or model_config"):
        build_vision_lm(processors["llava"])
    with pytest.raises(ConfigError, match="the tokenizer has no <image> token"):
        build_vision_lm(processors["qwen2_vl"], model_config=TINY_LLAVA)
    with pytest.raises(ModelError, match="processor path not found: ./nowhere"):
        load_processor("./nowhere")
    chat_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="has no image processor: not a vision-language model"):
        load_processor(str(tmp_path))


# --- The transformers 5.23 behaviours the Qwen-VL workarounds in models/vision.py exist for. When one of these tests
# fails, transformers has fixed it: remove the workaround it names.


def test_workaround_still_needed_qwen_vl_processor_refuses_to_be_built_without_a_video_processor(processors):
    """`_processor_without_video`: the class check of the parts refuses (or, without torchvision, cannot look up)
    the video processor's class."""
    from transformers import Qwen2VLProcessor

    built = processors["qwen2_vl"]
    with pytest.raises((AttributeError, TypeError, ValueError)):
        Qwen2VLProcessor(image_processor=built.image_processor, tokenizer=built.tokenizer)


def test_workaround_still_needed_qwen_vl_processor_save_pretrained_fails_without_a_video_processor(
    tmp_path, processors
):
    """`save_processor`'s own writing of the parts: `save_pretrained` reads `_auto_class` of the None."""
    with pytest.raises(AttributeError, match="_auto_class"):
        processors["qwen2_vl"].save_pretrained(tmp_path)


def test_workaround_still_needed_qwen_vl_folder_needs_torchvision_for_auto_processor(tmp_path, processors):
    """`load_processor`'s building from parts: AutoProcessor loads the video processor, which needs torchvision."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        pytest.skip("torchvision is installed: AutoProcessor builds the video processor")
    save_processor(processors["qwen2_vl"], tmp_path)
    with pytest.raises(ImportError, match="Qwen2VLVideoProcessor requires the Torchvision library"):
        AutoProcessor.from_pretrained(tmp_path)
    # What a loader with torchvision builds it from: the image processor's settings, under the video class.
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["video_processor"].pop("video_processor_type") == "Qwen2VLVideoProcessor"
    assert saved["video_processor"] == {
        k: v for k, v in saved["image_processor"].items() if k != "image_processor_type"
    }
