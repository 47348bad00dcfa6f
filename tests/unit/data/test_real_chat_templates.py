"""The loss mask under real models' chat templates (tests/assets/chat_templates, sources in SOURCES.md there).

Each template is set on a small byte-level BPE tokenizer that has its markers as special tokens, put through
`setup_chat_template` as a recipe does, and conversations are tokenised by `tokenize_conversations`. What carries
loss is decoded run by run and compared with what the model should generate for each assistant turn; templates
that cannot be masked, or that drop part of a conversation, must stop with a line that says why.
"""

from __future__ import annotations

import json
import logging

import pytest
from support import ASSETS
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tunebook.data.formats import normalise_messages, to_conversations
from tunebook.data.tokenize import IGNORE_INDEX, tokenize_conversations
from tunebook.errors import DataError
from tunebook.models.tokenizer import setup_chat_template

TEMPLATES = ASSETS / "chat_templates"
# bos, eos (as the model's tokenizer has them), and the template's other markers
MARKERS = {
    "llama-3.1-instruct": ("<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>",
                                                              "<|eom_id|>", "<|python_tag|>"]),
    "qwen2.5-instruct": (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>", "<tool_call>", "</tool_call>"]),
    "qwen3": (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>", "<think>", "</think>"]),
    "phi-3.5-mini-instruct": ("<s>", "<|endoftext|>", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]),
    "gemma-2-it": ("<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"]),
    "mistral-nemo-instruct-2407": ("<s>", "</s>", ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                                   "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]),
    "granite-3.3-instruct": ("<|end_of_text|>", "<|end_of_text|>", ["<|start_of_role|>", "<|end_of_role|>",
                                                                    "<|tool_call|>"]),
    "gpt-oss": ("<|startoftext|>", "<|return|>", ["<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                                  "<|constrain|>", "<|call|>", "<|endoftext|>"]),
    "deepseek-r1-distill": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", ["<｜User｜>", "<｜Assistant｜>"]),
    "smollm2-instruct": (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"]),
}  # fmt: skip

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]  # fmt: skip


def _call(name, city="Paris", id="call0ABCD"):
    return {"id": id, "type": "function", "function": {"name": name, "arguments": {"city": city}}}


U1, A1, U2, A2 = ({"role": "user", "content": "Q1 alpha?"}, {"role": "assistant", "content": "A1 first."},
                  {"role": "user", "content": "Q2 beta?"}, {"role": "assistant", "content": "A2 second."})  # fmt: skip
SYSTEM = {"role": "system", "content": "Be brief."}
TOOL_FLOW = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [_call("get_weather")]},
             {"role": "tool", "content": "sunny 21C", "tool_call_id": "call0ABCD"},
             {"role": "assistant", "content": "Sunny."}]  # fmt: skip
CONVERSATIONS = {
    "single": ([U1, A1], None),
    "system": ([SYSTEM, U1, A1], None),
    "multi": ([U1, A1, U2, A2], None),
    "tools": (TOOL_FLOW, TOOLS),
    "json result": ([*TOOL_FLOW[:2], {**TOOL_FLOW[2], "content": '{"sky": "sunny", "temp": 21}'}, TOOL_FLOW[3]],
                    TOOLS),
    "text beside a call": ([TOOL_FLOW[0], {**TOOL_FLOW[1], "content": "Let me check."}, *TOOL_FLOW[2:]], TOOLS),
    "parallel calls": ([TOOL_FLOW[0], {**TOOL_FLOW[1], "tool_calls": [_call("get_weather"), _call("get_time", "Rome",
                        "call1EFGH")]}, TOOL_FLOW[2], {"role": "tool", "content": "noon", "tool_call_id": "call1EFGH"}, TOOL_FLOW[3]],
                       [*TOOLS, {"type": "function", "function": {**TOOLS[0]["function"], "name": "get_time"}}]),
}  # fmt: skip

# (template, conversation) -> the loss-bearing text of each assistant turn, or the error it must stop with.
CORRECT = {
    ("llama-3.1-instruct", "multi"): ["A1 first.<|eot_id|>", "A2 second.<|eot_id|>"],
    ("llama-3.1-instruct", "system"): ["A1 first.<|eot_id|>"],
    ("llama-3.1-instruct", "tools"): ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                                      "Sunny.<|eot_id|>"],
    # Llama 3.1 renders a tool result with tojson: a JSON result is escaped in the text, and still found there.
    ("llama-3.1-instruct", "json result"): ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                                            "Sunny.<|eot_id|>"],
    ("qwen2.5-instruct", "multi"): ["A1 first.<|im_end|>\n", "A2 second.<|im_end|>\n"],
    ("qwen2.5-instruct", "parallel calls"): [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n', "Sunny.<|im_end|>\n"],
    ("qwen3", "single"): ["<think>\n\n</think>\n\nA1 first.<|im_end|>\n"],  # as Qwen3 renders a final turn
    # Phi-3's template closes a conversation with its own EOS, which stays <|endoftext|> although <|end|> becomes EOS
    ("phi-3.5-mini-instruct", "single"): ["A1 first.<|end|>\n<|endoftext|>"],
    ("phi-3.5-mini-instruct", "multi"): ["A1 first.<|end|>\n", "A2 second.<|end|>\n<|endoftext|>"],
    ("gemma-2-it", "multi"): ["A1 first.<end_of_turn>\n", "A2 second.<end_of_turn>\n"],
    ("mistral-nemo-instruct-2407", "multi"): ["A1 first.</s>", "A2 second.</s>"],
    ("mistral-nemo-instruct-2407", "parallel calls"): [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call0ABCD"}, {"name": "get_time", '
        '"arguments": {"city": "Rome"}, "id": "call1EFGH"}]</s>', "Sunny.</s>"],
    ("granite-3.3-instruct", "multi"): ["A1 first.<|end_of_text|>\n", "A2 second.<|end_of_text|>\n"],
    ("gpt-oss", "single"): ["<|channel|>final<|message|>A1 first.<|return|>"],
    ("gpt-oss", "tools"): [' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
                           "<|channel|>final<|message|>Sunny.<|return|>"],
    ("smollm2-instruct", "multi"): ["A1 first.<|im_end|>\n", "A2 second.<|im_end|>\n"],
}  # fmt: skip
REFUSED = {
    # Earlier turns re-rendered once a later user turn follows (Qwen3 drops their empty think block).
    ("qwen3", "multi"): r"differently around message 2 \(assistant\).*assistant\\n<think>\\n\\n</think>.* when it is the last",
    ("gpt-oss", "multi"): r"differently around message 2 \(assistant\)",  # <|return|> last, <|end|> before
    ("deepseek-r1-distill", "single"): r"differently around message 2 .*in the prompt that asks for it",
    ("gemma-2-it", "system"): r"cannot render this conversation: System role not supported",
    # Mistral's templates put the system prompt only into a final user turn: training would silently lose it.
    ("mistral-nemo-instruct-2407", "system"): r"does not render the system message 'Be brief.'",
    ("granite-3.3-instruct", "tools"): r"does not render the tool call 'get_weather' in its assistant turn",
    ("gpt-oss", "parallel calls"): r"does not render the tool call 'get_time' in its assistant turn",
    ("llama-3.1-instruct", "text beside a call"): r"does not render the assistant message 'Let me check.' in its turn "
                                                  r"beside its tool calls",
    ("smollm2-instruct", "tools"): r"does not render the tool definition 'get_weather'",
}  # fmt: skip


def _tokenizer(name: str) -> PreTrainedTokenizerFast:
    bos, eos, markers = MARKERS[name]
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    model.train_from_iterator(["Q1 alpha? A1 first. Q2 beta? A2 second. Weather in Paris? Sunny."], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model)
    special = {"eos_token": AddedToken(eos, special=True, normalized=False)}
    if bos:
        special["bos_token"] = AddedToken(bos, special=True, normalized=False)
    special["additional_special_tokens"] = [AddedToken(m, special=True, normalized=False) for m in markers]
    tokenizer.add_special_tokens(special)
    tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return setup_chat_template(tokenizer, None, False, logging.getLogger("test"))


def _loss_runs(name: str, conversation: str) -> list[str]:
    tokenizer = _tokenizer(name)
    messages, tools = CONVERSATIONS[conversation]
    row = {"messages": normalise_messages(json.loads(json.dumps(messages)), "test"), "tools": tools}
    out = tokenize_conversations({"conversation": [json.dumps(row)]}, tokenizer=tokenizer, max_seq_length=4096,
                                 overlong="truncate", assistant_only_loss=True)  # fmt: skip
    runs, current = [], []
    for token, label in zip(out["input_ids"][0], out["labels"][0]):
        if label != IGNORE_INDEX:
            current.append(token)
        elif current:
            runs, current = [*runs, tokenizer.decode(current)], []
    return runs + ([tokenizer.decode(current)] if current else [])


@pytest.mark.parametrize(("name", "conversation"), list(CORRECT), ids=[" / ".join(k) for k in CORRECT])
def test_each_assistant_turn_and_its_end_of_turn_carry_the_loss(name, conversation):
    assert _loss_runs(name, conversation) == CORRECT[name, conversation]


@pytest.mark.parametrize(("name", "conversation"), list(REFUSED), ids=[" / ".join(k) for k in REFUSED])
def test_a_conversation_the_template_cannot_mask_or_drops_part_of_stops_with_the_reason(name, conversation):
    with pytest.raises(DataError, match=REFUSED[name, conversation]):
        _loss_runs(name, conversation)


def test_the_end_of_turn_token_becomes_eos_and_phi3_still_closes_with_its_own(tmp_path):
    expected = {"llama-3.1-instruct": "<|eot_id|>", "phi-3.5-mini-instruct": "<|end|>", "gemma-2-it": "<end_of_turn>",
                "granite-3.3-instruct": "<|end_of_text|>", "gpt-oss": "<|return|>", "qwen3": "<|im_end|>"}  # fmt: skip
    for name, eos in expected.items():
        assert _tokenizer(name).eos_token == eos, name
    phi = _tokenizer("phi-3.5-mini-instruct")
    phi.save_pretrained(tmp_path)
    reloaded = setup_chat_template(PreTrainedTokenizerFast.from_pretrained(tmp_path), None, False, logging.getLogger())
    text = reloaded.apply_chat_template([U1, A1], tokenize=False)
    assert reloaded.eos_token == "<|end|>" and text.endswith("A1 first.<|end|>\n<|endoftext|>"), text


def test_preference_pairs_get_the_same_checks_and_closing():
    from tunebook.preference.data import prompt_and_response_texts

    chosen, rejected = [A1], [{"role": "assistant", "content": "A1 wrong."}]
    _, rests = prompt_and_response_texts(_tokenizer("phi-3.5-mini-instruct"), [U1], [chosen, rejected], None, "p")
    assert rests == ["A1 first.<|end|>\n<|endoftext|>", "A1 wrong.<|end|>\n<|endoftext|>"]
    # Qwen3 renders the earlier turn of a multi-turn prompt as history in both, and the response as a final turn.
    prompt, rests = prompt_and_response_texts(_tokenizer("qwen3"), [U1, A1, U2], [[A2], [A1]], None, "p")
    assert prompt.endswith(
        "assistant\nA1 first.<|im_end|>\n<|im_start|>user\nQ2 beta?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert rests == ["<think>\n\n</think>\n\nA2 second.<|im_end|>\n", "<think>\n\n</think>\n\nA1 first.<|im_end|>\n"]
    with pytest.raises(DataError, match="prefs.jsonl, row 3: the chat template does not render the system message"):
        nemo = _tokenizer("mistral-nemo-instruct-2407")
        prompt_and_response_texts(nemo, [SYSTEM, U1], [chosen, rejected], None, "prefs.jsonl, row 3")


def _split_examples(name: str, conversation: str) -> list[tuple[str, list[str]]]:
    """(text, loss-bearing runs) of each example `split_turns` makes of a conversation."""
    tokenizer = _tokenizer(name)
    messages, tools = CONVERSATIONS[conversation]
    row = {"messages": normalise_messages(json.loads(json.dumps(messages)), "test"), "tools": tools}
    origin: list[int] = []
    out = tokenize_conversations({"conversation": [json.dumps(row)] * 2}, tokenizer=tokenizer, max_seq_length=4096,
                                 overlong="truncate", assistant_only_loss=True, split_turns=True, origin=origin,
                                 first_id=10)  # fmt: skip
    assert origin == sorted(origin) and out["conversation_id"] == [10 + r for r in origin]
    examples = []
    for ids, labels in zip(out["input_ids"][: len(out["input_ids"]) // 2], out["labels"]):
        runs = [tokenizer.decode([t for t, y in zip(ids, labels) if y != IGNORE_INDEX])]
        examples.append((tokenizer.decode(ids), runs))
    return examples


def test_split_turns_trains_each_turn_as_generated_where_the_whole_conversation_cannot():
    (first, loss1), (second, loss2) = _split_examples("qwen3", "multi")
    assert loss1 == ["<think>\n\n</think>\n\nA1 first.<|im_end|>\n"] and loss2 == [
        "<think>\n\n</think>\n\nA2 second.<|im_end|>\n"]  # fmt: skip
    # The history as Qwen3 renders it at generation time: the earlier turn without its think block.
    assert "<|im_start|>assistant\nA1 first.<|im_end|>\n<|im_start|>user\nQ2 beta?" in second
    (_, oss1), (_, oss2) = _split_examples("gpt-oss", "multi")
    assert oss1 == ["<|channel|>final<|message|>A1 first.<|return|>"]
    assert oss2 == ["<|channel|>final<|message|>A2 second.<|return|>"]


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "llama-3.1-instruct", "smollm2-instruct"])
def test_split_turns_on_a_template_that_renders_turns_alike_trains_the_same_tokens(name):
    split = [run for _, runs in _split_examples(name, "multi") for run in runs]
    assert split == _loss_runs(name, "multi")


def test_split_turns_still_refuses_a_template_that_drops_part_of_the_conversation():
    with pytest.raises(DataError, match="does not render the system message"):
        _split_examples("mistral-nemo-instruct-2407", "system")
    with pytest.raises(DataError, match="in the prompt that asks for it"):  # DeepSeek-R1 forces <think> in the prompt
        _split_examples("deepseek-r1-distill", "single")


def test_a_held_out_split_of_split_turns_keeps_each_conversation_on_one_side():
    import datasets

    from tunebook.data.sft import held_out_split

    ids = [c for c in range(50) for _ in range(1 + c % 4)]  # conversations of 1-4 turns, one example each
    data = datasets.Dataset.from_dict({"input_ids": [[i] for i in range(len(ids))], "conversation_id": ids})
    train, held = held_out_split(data, 0.2, seed=0)
    train_ids, held_ids = set(train["conversation_id"]), set(held["conversation_id"])
    assert not train_ids & held_ids and len(held_ids) == 10 and len(train) + len(held) == len(ids)
    assert sorted(held["conversation_id"]) == sorted(c for c in ids if c in held_ids)  # every turn of each
    plain, plain_held = held_out_split(data.remove_columns("conversation_id"), 0.2, seed=0)  # without ids: by example
    assert len(plain_held) == round(0.2 * len(ids))


def _prompt_completion(tokenizer, prompt: list[dict], completion: list[dict], split_turns: bool = False) -> dict:
    """A TRL conversational prompt/completion row through the SFT path: formats, then tokenisation and masking."""
    rows = to_conversations({"prompt": [prompt], "completion": [completion]}, data_format="prompt_completion",
                            where="pc.jsonl")  # fmt: skip
    return tokenize_conversations(rows, tokenizer=tokenizer, max_seq_length=4096, overlong="truncate",
                                  assistant_only_loss=True, split_turns=split_turns)  # fmt: skip


@pytest.mark.parametrize("name", ["llama-3.1-instruct", "qwen2.5-instruct", "qwen3", "phi-3.5-mini-instruct",
                                  "gemma-2-it", "mistral-nemo-instruct-2407", "granite-3.3-instruct",
                                  "smollm2-instruct"])  # fmt: skip
def test_a_prompt_with_earlier_assistant_turns_is_context_only_the_completion_carries_loss(name):
    """TRL's completion_only_loss: the labels are the prompt+completion tokens past those of the prompt rendered
    with its generation prompt, computed here as TRL does (two renderings, two tokenisations), token for token."""
    tokenizer = _tokenizer(name)
    prompt, completion = [U1, A1, U2], [A2]
    out = _prompt_completion(tokenizer, prompt, completion)
    prompt_ids = tokenizer(tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"]  # fmt: skip
    ids = tokenizer(tokenizer.apply_chat_template(prompt + completion, tokenize=False), add_special_tokens=False)
    ids = ids["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids  # what TRL checks before it masks by length
    assert out["input_ids"] == [ids]
    assert out["labels"] == [[IGNORE_INDEX] * len(prompt_ids) + ids[len(prompt_ids) :]]
    assert "A2 second." in tokenizer.decode(ids[len(prompt_ids) :]) and "A1" not in tokenizer.decode(
        ids[len(prompt_ids) :]
    )


@pytest.mark.parametrize("name", ["llama-3.1-instruct", "qwen2.5-instruct", "phi-3.5-mini-instruct", "gemma-2-it"])
def test_a_single_turn_prompt_completion_row_trains_what_the_same_conversation_does(name):
    tokenizer = _tokenizer(name)
    out = _prompt_completion(tokenizer, [U1], [A1])
    row = {"messages": [U1, A1]}
    chat = tokenize_conversations({"conversation": [json.dumps(row)]}, tokenizer=tokenizer, max_seq_length=4096,
                                  overlong="truncate", assistant_only_loss=True)  # fmt: skip
    assert out["input_ids"] == chat["input_ids"] and out["labels"] == chat["labels"]
    assert out["prompt_length"] == chat["prompt_length"]


def test_split_turns_makes_no_example_of_a_prompts_assistant_turn():
    """Qwen3 renders an earlier turn differently once a later user turn follows: as context of the prompt, it no
    longer needs to be located, and with split_turns it is no example of its own."""
    tokenizer = _tokenizer("qwen3")
    completion_only = ["<think>\n\n</think>\n\nA2 second.<|im_end|>\n"]
    out = _prompt_completion(tokenizer, [U1, A1, U2], [A2], split_turns=True)
    assert len(out["input_ids"]) == 1
    assert [tokenizer.decode([t for t, y in zip(out["input_ids"][0], out["labels"][0]) if y != IGNORE_INDEX])] == (
        completion_only
    )


def test_the_grpo_warm_up_trains_on_the_answer_not_on_the_prompts_assistant_turns():
    import datasets

    from tunebook.rl.prompts import reference_examples

    tokenizer = _tokenizer("llama-3.1-instruct")
    prompts = datasets.Dataset.from_list([{"prompt": [U1, A1, U2], "answer": "A2 second."}])
    example = reference_examples(prompts, tokenizer, "answer", 4096)[0]
    trained = [t for t, y in zip(example["input_ids"], example["labels"]) if y != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "A2 second.<|eot_id|>"
