"""Preference pairs tokenised: overlong pairs cut or dropped with the prompt kept whole; synthetic pairs differ."""

from __future__ import annotations

import random

from tunebook.preference.data import make_preference, tokenize_pairs

PAIRS = {
    "prompt": ["Reverse the digits.\n1234", [{"role": "user", "content": "Sort the digits in ascending order.\n391"}]],
    "chosen": ["4321", [{"role": "assistant", "content": "139"}]],
    "rejected": ["1234", "193"],
}


def test_overlong_pairs_are_cut_or_dropped_and_synthetic_pairs_differ(tiny_tokenizer):
    full = tokenize_pairs(PAIRS, [0, 1], tokenizer=tiny_tokenizer, max_seq_length=1000, overlong="drop", where="t")
    prompt_lengths = [labels.count(-100) for labels in full["chosen_labels"]]
    limit = max(prompt_lengths) + 1  # both prompts fit, not every response
    args = {"tokenizer": tiny_tokenizer, "max_seq_length": limit, "where": "test"}
    cut = tokenize_pairs(PAIRS, [0, 1], overlong="truncate", **args)
    dropped = tokenize_pairs(PAIRS, [0, 1], overlong="drop", **args)
    assert cut["keep"] == [True, True] and any(cut["truncated"])
    assert all(len(ids) <= limit for ids in cut["chosen_input_ids"] + cut["rejected_input_ids"])
    assert cut["chosen_labels"][0][: prompt_lengths[0]] == [-100] * prompt_lengths[0]  # the prompt kept whole
    assert dropped["keep"] == [not t for t in cut["truncated"]]
    too_short = tokenize_pairs(PAIRS, [0, 1], overlong="truncate", **{**args, "max_seq_length": min(prompt_lengths)})
    assert too_short["keep"] == [False, False]  # no room for any response: dropped even when truncating
    rng = random.Random(0)
    for _ in range(50):
        pair = make_preference(rng)
        assert pair["chosen"] != pair["rejected"] and len(pair["chosen"]) == len(pair["rejected"])
