"""The chat recipes' tokenizer set-up: a base tokenizer without a template gets ChatML and an EOS that ends turns; a
template from elsewhere; a template whose turns never end is refused."""

from __future__ import annotations

import logging

import pytest
from support import base_tokenizer
from transformers import AutoTokenizer

from tunebook.errors import ConfigError
from tunebook.models.tokenizer import setup_chat_template

log = logging.getLogger("test")


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


def test_the_tokenizer_saved_with_the_model_stops_at_the_end_of_turn(tmp_path):
    tokenizer = setup_chat_template(base_tokenizer(), None, False, log)
    tokenizer.save_pretrained(tmp_path / "tok")
    again = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert again.eos_token == "<|im_end|>" and again.chat_template == tokenizer.chat_template
