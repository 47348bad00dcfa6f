"""Models and tokenizers as users bring them: base tokenizers without a chat template, templates from elsewhere,
multi-EOS generation configs, checkpoints stored in bf16 or as pickles."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

from tunebook.errors import ConfigError, ModelError
from tunebook.models import build_causal_lm, setup_chat_template

log = logging.getLogger("test")


def base_tokenizer(eos: str = "<|endoftext|>", extra: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A base model's tokenizer: byte-level BPE, an EOS token, no chat template, no ChatML markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = ["user assistant question answer 0123456789 Reverse the digits. Sort the digits."] * 20
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[eos, *extra], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos)


def test_a_tokenizer_without_a_template_gets_chatml_with_marker_tokens_and_the_end_of_turn_as_eos():
    tokenizer = setup_chat_template(base_tokenizer(), None, False, log)
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"
    assert len(tokenizer("<|im_start|><|im_end|>", add_special_tokens=False)["input_ids"]) == 2  # one token each
    # The old EOS is still a special token: decoding skips it.
    old = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.decode([old], skip_special_tokens=True) == ""


def test_chat_template_from_text_a_jinja_file_or_a_tokenizer_directory(tmp_path):
    llama3 = (
        "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] "
        "+ '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
        "<|end_header_id|>\n\n' }}{% endif %}"
    )
    specials = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    tokenizer = setup_chat_template(base_tokenizer("<|end_of_text|>", specials), llama3, False, log)
    assert tokenizer.chat_template == llama3 and tokenizer.eos_token == "<|eot_id|>"

    (tmp_path / "t.jinja").write_text(llama3)
    assert setup_chat_template(base_tokenizer("<|end_of_text|>", specials), str(tmp_path / "t.jinja"), False, log)
    source = base_tokenizer("<|end_of_text|>", specials)
    source.chat_template = llama3
    source.save_pretrained(tmp_path / "instruct")
    tokenizer = setup_chat_template(
        base_tokenizer("<|end_of_text|>", specials), str(tmp_path / "instruct"), False, log
    )
    assert tokenizer.chat_template == llama3 and tokenizer.eos_token == "<|eot_id|>"
    with pytest.raises(ConfigError, match="chat_template file not found"):
        setup_chat_template(base_tokenizer(), str(tmp_path / "missing.jinja"), False, log)


def test_a_template_whose_turns_end_without_a_special_token_is_refused():
    alpaca = "{% for m in messages %}{{ '### ' + m['role'] + ':\n' + m['content'] + '\n\n' }}{% endfor %}"
    with pytest.raises(ConfigError, match="holds no special token: a model trained on it never learns to stop"):
        setup_chat_template(base_tokenizer(), alpaca, False, log)


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


def test_the_tokenizer_saved_with_the_model_stops_at_the_end_of_turn(tmp_path):
    tokenizer = setup_chat_template(base_tokenizer(), None, False, log)
    tokenizer.save_pretrained(tmp_path / "tok")
    again = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert again.eos_token == "<|im_end|>" and again.chat_template == tokenizer.chat_template


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
