"""`tunebook chat`: one shot and a conversation with a saved model, a LoRA adapter, and the one line for a directory
that is no model."""

from __future__ import annotations

import io
import json

import pytest
from support import CHAT_REPLY

from tunebook.cli.chat import Chat, chat, load_chat_model
from tunebook.errors import ConfigError


class Recorder(io.StringIO):
    """The terminal: what was written, piece by piece."""

    def __init__(self):
        super().__init__()
        self.pieces = []

    def write(self, text):
        self.pieces.append(text)
        return super().write(text)


def test_one_shot_streams_the_reply_and_stops_at_the_end_of_turn(tiny_chat_model_dir, capsys):
    out = Recorder()
    chat([str(tiny_chat_model_dir), "--prompt", "hi", "--max_new_tokens", "40"], out=out)
    # The model's generation config ends at <|endoftext|>; the reply ends at the tokenizer's <|im_end|>, before the
    # next turn it learnt ("<|im_start|>user ...") would print.
    assert out.getvalue() == CHAT_REPLY + "\n"
    assert len([p for p in out.pieces if p.strip()]) >= 3  # word by word, as generated

    from tunebook.cli import main

    main(["chat", str(tiny_chat_model_dir), "--prompt", "what is it?"])  # the command, to the terminal
    assert capsys.readouterr().out == CHAT_REPLY + "\n"


def test_a_conversation_keeps_its_history_until_reset_and_ends_on_an_empty_line(tiny_chat_model_dir):
    lines = iter(["hi", "what is it?", "/reset", "hi", "", "never read"])
    out = Recorder()
    chat([str(tiny_chat_model_dir)], read=lambda prompt: next(lines), out=out)
    assert out.getvalue().splitlines()[1:] == [CHAT_REPLY, CHAT_REPLY, "(history cleared)", CHAT_REPLY]
    assert next(lines) == "never read"

    model, tokenizer = load_chat_model(tiny_chat_model_dir)
    session = Chat(model, tokenizer, system="Be brief.", max_new_tokens=24)
    session.reply("hi")
    session.reply("what is it?")
    assert [m["role"] for m in session.history] == ["user", "assistant"] * 2
    assert session.history[-1]["content"] == CHAT_REPLY
    session.reset()
    assert session.history == []


def test_a_tokenizer_without_a_chat_template_gets_plain_text(tiny_chat_model_dir):
    model, tokenizer = load_chat_model(tiny_chat_model_dir)
    tokenizer.chat_template = None
    session = Chat(model, tokenizer, max_new_tokens=3)
    first = session.reply("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")  # the template, by hand
    assert first and CHAT_REPLY.startswith(first) and not session.templated
    assert session.text.startswith("<|im_start|>user\nhi") and session.text.endswith(first + "\n")


def test_a_lora_adapter_chats_with_its_base_model(tiny_chat_model_dir, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunebook.evaluation import generate_reply, prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    adapter_dir = tmp_path / "adapter"
    base = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir)
    base.save_pretrained(adapter_dir / "base_model")  # a base saved beside the adapter, named relative to it
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    torch.manual_seed(1)
    for name, weight in model.named_parameters():
        if "lora_B" in name:  # trained adapters: their update is not zero
            weight.data.normal_(0, 0.5)
    expected = generate_reply(model.eval(), tokenizer, prompt_ids(tokenizer, [{"role": "user", "content": "hi"}]),
                              max_new_tokens=12)  # fmt: skip
    model.peft_config["default"].base_model_name_or_path = "base_model"
    model.save_pretrained(adapter_dir)
    tokenizer.save_pretrained(adapter_dir)
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == "base_model"

    out = io.StringIO()
    chat([str(adapter_dir), "--prompt", "hi", "--max_new_tokens", "12"], out=out)
    assert out.getvalue() == expected + "\n"
    loaded, _ = load_chat_model(adapter_dir)
    assert type(loaded).__name__ == "PeftModelForCausalLM"


def test_a_checkpoint_or_a_folder_without_a_model_is_one_line_saying_what_to_do(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoints" / "step-4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"is a training checkpoint, not a model: tunebook export .*step-4 OUT_DIR"):
        chat([str(checkpoint)])
    with pytest.raises(ConfigError, match=r"holds checkpoints but no model .* tunebook export .*step-4 OUT_DIR"):
        chat([str(tmp_path / "run")])
    with pytest.raises(ConfigError, match="is not a model directory") as error:
        chat([str(tmp_path)])
    assert "\n" not in str(error.value)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(ConfigError, match="is a sequence classifier"):
        chat([str(tmp_path)])
