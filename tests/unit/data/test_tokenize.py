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


def test_a_batch_equals_its_rows_tokenised_alone_and_the_per_token_rule(tiny_tokenizer):
    rows = [json.dumps({"messages": CHAT}), json.dumps({"text": "plain words"}), json.dumps({"messages": CHAT[1:3]}),
            json.dumps({"text": "more"})]  # fmt: skip
    kwargs = {"tokenizer": tiny_tokenizer, "max_seq_length": 512, "overlong": "truncate", "assistant_only_loss": True}
    batch = tokenize_conversations({"conversation": rows}, **kwargs)
    for i, row in enumerate(rows):
        alone = tokenize_conversations({"conversation": [row]}, **kwargs)
        assert {k: v[0] for k, v in alone.items()} == {k: v[i] for k, v in batch.items()}
    # The plain computation: tokens whose first character lies in an assistant span carry the loss.
    for i, conversation in ((0, CHAT), (2, CHAT[1:3])):
        text, spans = assistant_spans(tiny_tokenizer, conversation)
        enc = tiny_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = [start for start, _ in enc["offset_mapping"]]
        assert batch["input_ids"][i] == enc["input_ids"]
        assert batch["labels"][i] == [t if any(a <= s < b for a, b in spans) else IGNORE_INDEX
                                      for t, s in zip(enc["input_ids"], starts)]  # fmt: skip
        assert batch["prompt_length"][i] == next(j for j, s in enumerate(starts) if s >= spans[-1][0])
    # Plain text: the tokenizer's own special tokens, then EOS; loss everywhere.
    plain = tiny_tokenizer("plain words")["input_ids"]
    assert batch["input_ids"][1] == plain + [tiny_tokenizer.eos_token_id] == batch["labels"][1]


def test_loss_mask_of_offsets_in_and_out_of_text_order():
    from tunebook.data.tokenize import _chat_labels

    ids, spans = [10, 11, 12, 13, 14], [(5, 9)]
    for offsets in ([(0, 2), (2, 5), (5, 7), (7, 9), (9, 10)], [(0, 2), (5, 7), (2, 5), (7, 9), (9, 10)]):
        labels, prompt_length = _chat_labels(ids, offsets, spans, 10, assistant_only_loss=True)
        assert labels == [t if 5 <= s < 9 else IGNORE_INDEX for t, (s, _) in zip(ids, offsets)]
        assert prompt_length == next(j for j, (s, _) in enumerate(offsets) if s >= 5)
        assert _chat_labels(ids, offsets, spans, 10, assistant_only_loss=False)[0] == ids


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
    with pytest.raises(DataError, match="renders the conversation differently around message 3"):
        assistant_spans(broken, CHAT)
