"""What an inference engine receives (`tunebook.rl.engine_weights`): the policy's weights under a plain checkpoint's
names, LoRA adapters merged exactly as peft's `merge_and_unload` merges them, nothing changed in the policy."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from support import TINY_TEST_MODEL

from tunebook.models import apply_lora
from tunebook.rl.engine_weights import engine_weights, write_engine_model


def _llama(tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    settings = {k: v for k, v in TINY_TEST_MODEL.items() if k not in ("model_type", "tie_word_embeddings")}
    return LlamaForCausalLM(LlamaConfig(**settings, vocab_size=64, tie_word_embeddings=tie))


def _lora(model, **keys):
    settings = {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_target_modules": "all-linear",
                "modules_to_save": None, "freeze_projector": False}  # fmt: skip
    config = SimpleNamespace(**{**settings, **keys})
    peft_model = apply_lora(model, config)
    with torch.no_grad():  # trained adapters: B is zero at the start, which would make any merge look right
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    return peft_model


def test_a_plain_model_gives_its_state_dict():
    model = _llama()
    got = dict(engine_weights(model))
    assert got.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(got[name], tensor)


@pytest.mark.parametrize("extra", ["lora", "modules_to_save", "new_token_rows"])
def test_lora_weights_arrive_merged_as_merge_and_unload_merges_them(extra):
    model = _llama()
    if extra == "new_token_rows":  # tokens the tokenizer added train their rows (peft's trainable tokens)
        model.new_token_rows = [60, 61, 62, 63]
    if extra == "modules_to_save":  # a trained copy of the output layer replaces it
        peft_model = _lora(model, lora_target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    else:
        peft_model = _lora(model)
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    got = dict(engine_weights(peft_model))
    assert got.keys() == expected.keys()
    changed = 0
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=1e-6)  # float32: one add of the same delta
        changed += not torch.equal(tensor, _llama().state_dict()[name])
    assert changed > 0
    for name, tensor in peft_model.state_dict().items():  # computed, not merged in place
        assert torch.equal(tensor, before[name]), name


def test_the_written_directory_loads_as_the_merged_model(tmp_path):
    from transformers import AutoModelForCausalLM

    peft_model = _lora(_llama(tie=True))
    write_engine_model(peft_model, None, tmp_path / "engine")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "engine")
    merged = copy.deepcopy(peft_model).merge_and_unload()
    ids = torch.tensor([[3, 5, 7, 11, 13]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, merged(ids).logits, atol=1e-5, rtol=1e-5)
