"""Models as users bring them: multi-EOS generation configs, new token rows, checkpoints stored in bf16 or as pickles,
a Hub revision, and LoRA training the rows of added tokens."""

from __future__ import annotations

import logging

import pytest
import torch
from support import base_tokenizer
from transformers import AutoModelForCausalLM, GenerationConfig

from tunebook.errors import ModelError
from tunebook.models import build_causal_lm
from tunebook.models.tokenizer import setup_chat_template

log = logging.getLogger("test")


def test_new_token_rows_are_the_mean_and_the_models_other_eos_ids_stay(tmp_path, tiny_model_config):
    tokenizer = base_tokenizer()
    model = build_causal_lm(tokenizer, model_config=tiny_model_config)
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id, 7])  # e.g. Llama 3 Instruct
    model.save_pretrained(tmp_path / "base")
    rows = model.get_input_embeddings().weight.shape[0]

    chat = setup_chat_template(base_tokenizer(), None, False, log)
    tuned = build_causal_lm(chat, model_name_or_path=str(tmp_path / "base"))
    embeddings = tuned.get_input_embeddings().weight
    assert embeddings.shape[0] >= len(chat) > rows
    mean = model.get_input_embeddings().weight.mean(dim=0)
    torch.testing.assert_close(embeddings[rows:], mean.expand(embeddings.shape[0] - rows, -1))
    torch.testing.assert_close(tuned.get_output_embeddings().weight[rows:][0], model.lm_head.weight.mean(dim=0))
    assert tuned.generation_config.eos_token_id == [chat.eos_token_id, tokenizer.eos_token_id, 7]


def test_dtype_auto_trains_float32_weights_and_keeps_a_lora_base_as_stored(
    tmp_path, tiny_tokenizer, tiny_model_config
):
    build_causal_lm(tiny_tokenizer, model_config=tiny_model_config).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    path = str(tmp_path / "m")
    assert build_causal_lm(tiny_tokenizer, model_name_or_path=path).dtype == torch.float32
    assert build_causal_lm(tiny_tokenizer, model_name_or_path=path, frozen_base=True).dtype == torch.bfloat16
    assert build_causal_lm(tiny_tokenizer, model_name_or_path=path, dtype="bfloat16").dtype == torch.bfloat16
    fresh = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config, dtype="bfloat16")
    assert fresh.dtype == torch.bfloat16


def test_pickled_weights_load_only_when_allowed(tmp_path, tiny_tokenizer, tiny_model_config):
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config)
    model.config.save_pretrained(tmp_path / "bin")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(ModelError, match="only pickled .bin weights.*use_safetensors: false"):
        build_causal_lm(tiny_tokenizer, model_name_or_path=str(tmp_path / "bin"))
    loaded = build_causal_lm(tiny_tokenizer, model_name_or_path=str(tmp_path / "bin"), use_safetensors=False)
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)


def test_model_revision_reaches_from_pretrained(monkeypatch, tiny_tokenizer):
    seen = {}

    def spy(name, **kwargs):
        seen.update(kwargs, name=name)
        raise OSError("offline")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    with pytest.raises(ModelError, match="could not load a causal LM from 'org/model'"):
        build_causal_lm(tiny_tokenizer, model_name_or_path="org/model", revision="v1.2")
    assert seen["revision"] == "v1.2" and seen["use_safetensors"] is True and seen["dtype"] == torch.float32


@pytest.mark.parametrize("tied", [False, True])
def test_lora_trains_the_rows_of_added_tokens(tmp_path, tiny_model_config, tied):
    from types import SimpleNamespace

    from tunebook.models import apply_lora

    base = build_causal_lm(base_tokenizer(), model_config={**tiny_model_config, "tie_word_embeddings": tied})
    base.save_pretrained(tmp_path / "base")
    chat = setup_chat_template(base_tokenizer(), None, False, log)
    model = build_causal_lm(chat, model_name_or_path=str(tmp_path / "base"), frozen_base=True)
    added = list(model.new_token_rows)
    before = model.get_output_embeddings().weight.detach().clone()
    lora = SimpleNamespace(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="all-linear",
                           modules_to_save=None)  # fmt: skip
    peft_model = apply_lora(model, lora)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=0.1)
    ids = torch.tensor([[5, 6, chat.eos_token_id, 7]])
    peft_model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    merged = peft_model.merge_and_unload()
    changed = (merged.get_output_embeddings().weight - before).abs().sum(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= set(added) and chat.eos_token_id in changed


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error for machines without a CUDA GPU")
def test_liger_kernels_without_a_gpu_stop_with_one_line(tiny_tokenizer, tiny_model_config):
    from tunebook.errors import ConfigError

    with pytest.raises(ConfigError, match="use_liger_kernel: Liger's kernels are Triton kernels for CUDA GPUs"):
        build_causal_lm(tiny_tokenizer, model_config=tiny_model_config, use_liger_kernel=True)


def test_model_options_come_from_the_config_in_one_object_and_keywords_override_them(
    tiny_tokenizer, tiny_model_config
):
    from dataclasses import fields

    from tunebook.config import SFTConfig
    from tunebook.models import ModelOptions, model_options

    config = SFTConfig(gradient_checkpointing=True, use_peft=True, model_revision="v2", fused_cpu_layers=False)
    options = model_options(config)
    assert options == ModelOptions.from_config(config)
    assert (options.gradient_checkpointing, options.frozen_base, options.revision, options.fused_cpu_layers) == (
        True, True, "v2", False,
    )  # fmt: skip
    assert {f.name for f in fields(ModelOptions)} == {  # every build option, once
        "model_name_or_path", "model_config", "attn_implementation", "gradient_checkpointing", "trust_remote_code",
        "load_in_4bit", "dtype", "revision", "use_safetensors", "frozen_base", "use_liger_kernel", "fused_cpu_layers",
    }  # fmt: skip
    plain = ModelOptions.from_config(SFTConfig())
    assert build_causal_lm(tiny_tokenizer, plain, model_config=tiny_model_config).config.use_cache is not False
    model = build_causal_lm(tiny_tokenizer, plain, model_config=tiny_model_config, gradient_checkpointing=True)
    assert model.config.use_cache is False  # the keyword took: checkpointing turns the KV cache off
    with pytest.raises(TypeError):
        build_causal_lm(tiny_tokenizer, plain, no_such_option=True)


def test_a_new_head_on_a_pretrained_encoder_is_one_plain_line_not_transformers_load_report(
    tmp_path, caplog, monkeypatch
):
    from transformers import BertConfig, BertModel

    from tunebook.models.build import build_sequence_classifier

    tokenizer = base_tokenizer()
    encoder = BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=32))  # fmt: skip
    encoder.save_pretrained(tmp_path / "encoder")
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)  # its records reach caplog too
    monkeypatch.setattr(logging.getLogger("tunebook"), "propagate", True)
    # An earlier test's run may have left Tunebook's logger at WARNING (setup_logging on a non-main rank).
    with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, logger="tunebook"):
        build_sequence_classifier(tokenizer, ["a", "b"], model_name_or_path=str(tmp_path / "encoder"))
    assert "LOAD REPORT" not in caplog.text and "\x1b[" not in caplog.text
    lines = [r.getMessage() for r in caplog.records if r.name == "tunebook"]
    assert f"Not in {tmp_path / 'encoder'}, so newly initialised (trained from a random start): classifier.bias, " \
           "classifier.weight" in lines, lines  # fmt: skip
    # The filter was on that one logger for the load only: transformers' later records pass.
    assert not logging.getLogger("transformers.modeling_utils").filters
