"""Replies to prompts (`tunebook.evaluation.samples`): rendering, the stop at the end of turn, greedy samples that
leave training as it was."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support import CHAT_REPLY

from tunebook.evaluation import generate_reply, prompt_ids, prompt_sampler, sample_generations


@pytest.fixture(scope="module")
def chat_model(tiny_chat_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir), AutoTokenizer.from_pretrained(
        tiny_chat_model_dir
    )


def test_prompts_are_a_user_turn_with_the_generation_prompt_or_plain_text(tiny_tokenizer):
    chat = prompt_ids(tiny_tokenizer, [{"role": "user", "content": "hello"}])
    assert tiny_tokenizer.decode(chat) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.decode(prompt_ids(tiny_tokenizer, "hello world")) == "hello world"


def test_a_reply_ends_at_the_end_of_turn_token_not_the_generation_configs_eos(chat_model):
    model, tokenizer = chat_model
    ids = prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])
    # The model's own generation config ends at <|endoftext|>: left to it, generation runs on into a next turn.
    unstopped = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    assert "user" in tokenizer.decode(unstopped[0, len(ids) :], skip_special_tokens=True)
    assert generate_reply(model, tokenizer, ids, max_new_tokens=24) == CHAT_REPLY


def test_a_reply_streams_token_by_token_as_it_is_generated(chat_model):
    from transformers import TextStreamer

    model, tokenizer = chat_model
    pieces = []

    class Recorder(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            pieces.append((text, stream_end))

    ids = prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])
    reply = generate_reply(model, tokenizer, ids, max_new_tokens=24, streamer=Recorder(tokenizer, skip_prompt=True,
                                                                                         skip_special_tokens=True))  # fmt: skip
    assert "".join(text for text, _ in pieces) == reply == CHAT_REPLY
    assert len([text for text, _ in pieces if text]) >= 3 and pieces[-1][1]  # word by word, then the end


def test_samples_are_greedy_in_eval_mode_and_leave_the_model_and_random_state_as_they_were(chat_model):
    model, tokenizer = chat_model
    model.train()
    rng = torch.get_rng_state()
    one_process = SimpleNamespace(num_processes=1)
    samples = sample_generations(model, tokenizer, ["hi", "what is it?"], one_process, max_new_tokens=24, chat=True)
    assert samples == [{"prompt": "hi", "completion": CHAT_REPLY}, {"prompt": "what is it?", "completion": CHAT_REPLY}]
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    model.eval()


def test_the_sampler_is_none_without_sample_prompts_and_renders_plain_text_for_pretraining(chat_model):
    model, tokenizer = chat_model
    config = SimpleNamespace(sample_prompts=[], sample_max_new_tokens=2)
    assert prompt_sampler(config, model, tokenizer, SimpleNamespace(num_processes=1)) is None
    config.sample_prompts = ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]  # the template, by hand
    plain = prompt_sampler(config, model, tokenizer, SimpleNamespace(num_processes=1), chat=False)
    (sample,) = plain()
    assert sample["prompt"] == config.sample_prompts[0]
    assert sample["completion"] and CHAT_REPLY.startswith(sample["completion"]) != (sample["completion"] == CHAT_REPLY)
