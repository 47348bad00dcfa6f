from __future__ import annotations

import copy
import json

import pytest

from tunebook.data.tokenize import IGNORE_INDEX, assistant_spans, format_loss_mask, tokenize_conversations
from tunebook.errors import DataError

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "Again."},
    {"role": "assistant", "content": "hello again"},
]


def _tokenize(tokenizer, conversations, max_len=512, overlong="truncate", assistant_only=True):
    rows = [json.dumps({"messages": c}) for c in conversations]
    return tokenize_conversations(
        {"conversation": rows},
        tokenizer=tokenizer,
        max_seq_length=max_len,
        overlong=overlong,
        assistant_only_loss=assistant_only,
    )


def test_loss_only_on_assistant_turns_including_end_of_turn(tiny_tokenizer):
    out = _tokenize(tiny_tokenizer, [CHAT])
    ids, labels = out["input_ids"][0], out["labels"][0]
    loss_text = tiny_tokenizer.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])
    assert loss_text == "hello<|im_end|>\nhello again<|im_end|>\n"
    assert format_loss_mask(tiny_tokenizer, ids, labels).count("[[") == 2
    # labels equal the inputs wherever they are not masked
    assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(ids, labels))
    # the prompt for generation eval ends right after the last assistant header
    prompt = tiny_tokenizer.decode(ids[: out["prompt_length"][0]])
    assert prompt.endswith("Again.<|im_end|>\n<|im_start|>assistant\n")


def test_spans_match_template_rendering(tiny_tokenizer):
    text, spans = assistant_spans(tiny_tokenizer, CHAT)
    assert [text[a:b] for a, b in spans] == ["hello<|im_end|>\n", "hello again<|im_end|>\n"]


def test_assistant_only_loss_off_trains_on_everything(tiny_tokenizer):
    out = _tokenize(tiny_tokenizer, [CHAT], assistant_only=False)
    assert out["labels"][0] == out["input_ids"][0]


def test_truncation_and_dropping(tiny_tokenizer):
    full = _tokenize(tiny_tokenizer, [CHAT])
    n = len(full["input_ids"][0])
    cut = _tokenize(tiny_tokenizer, [CHAT], max_len=n - 3)
    assert len(cut["input_ids"][0]) == n - 3 and cut["truncated"][0] and cut["keep"][0]
    dropped = _tokenize(tiny_tokenizer, [CHAT], max_len=n - 3, overlong="drop")
    assert dropped["truncated"][0] and not dropped["keep"][0]


def test_examples_whose_answer_is_truncated_away_are_not_kept(tiny_tokenizer):
    out = _tokenize(tiny_tokenizer, [CHAT[:3]], max_len=6)
    assert not out["keep"][0]


def test_template_that_is_not_prefix_stable_is_a_clear_error(tiny_tokenizer):
    broken = copy.deepcopy(tiny_tokenizer)  # the fixture is session-scoped
    broken.chat_template = "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(DataError, match="renders a conversation's prefix differently"):
        assistant_spans(broken, CHAT)
