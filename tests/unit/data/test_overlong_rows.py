"""A row longer than anything trainable costs what its trainable part costs: it is left out of tokenizer training
(counted in the data stats) and tokenised from a head, for every recipe; every other example is untouched.

One 10 MB row of one repeated letter used to stall tokenizer training for hours (BPE training costs the square of
an unbroken run) and its tokenisation for half a minute. The work is asserted as characters handed to the tokenizer
trainer and to the tokenizer, not as wall time.
"""

from __future__ import annotations

import json
import logging
import random

import pytest
from transformers import PreTrainedTokenizerBase

import tunebook.models.tokenizer as tokenizer_module
from tunebook.data import synthetic
from tunebook.models.tokenizer import train_chat_tokenizer, train_encoder_tokenizer
from tunebook.preference.data import write_synthetic_preferences
from tunebook.recipe import RECIPES, recipe_config_class, recipe_data
from tunebook.rl.prompts import write_synthetic_prompts

LOG = logging.getLogger("test")
BIG = "a" * 10_000_000
MAX_SEQ_LENGTH = 128
WRITERS = {  # each recipe's generated data, and one over-long row in its format
    "sft": (synthetic.write_synthetic_task, {"text": BIG}),
    "classify": (synthetic.write_synthetic_classification, {"text": "music " * 1_700_000, "label": "music"}),
    "pretrain": (synthetic.write_synthetic_text, {"text": BIG[:1_000_000]}),  # trained on whole: tokenised whole
    "dpo": (write_synthetic_preferences, {"prompt": BIG, "chosen": "1", "rejected": "2"}),
    "kto": (write_synthetic_preferences, {"prompt": BIG, "completion": "1", "label": True}),  # pairs, and a row
    "reward": (write_synthetic_preferences, {"prompt": "Sort 21", "chosen": BIG, "rejected": "2"}),
    "grpo": (write_synthetic_prompts, {"prompt": BIG, "answer": "1"}),
    "distill": (synthetic.write_synthetic_task, {"text": BIG}),  # SFT's data
}
# The longest text of a pair, a prompt with its answer, or a message that can fit: tokenizer_max_chars' argument.
LONGEST_TRAINED = {"dpo": 2 * MAX_SEQ_LENGTH, "reward": 2 * MAX_SEQ_LENGTH, "grpo": 2 * MAX_SEQ_LENGTH}


def _spy(monkeypatch) -> dict[str, list[int]]:
    """Lengths of the texts handed to the tokenizer trainers and to any tokenizer call, as they are read."""
    seen: dict[str, list[int]] = {"trainer": [], "tokenizer": []}
    for kind, train in dict(tokenizer_module.TRAINERS).items():

        def counted(texts, vocab_size, train=train):
            def read():
                for text in texts:
                    seen["trainer"].append(len(text))
                    assert len(text) < 1_000_000, "a 10 MB text reached the tokenizer trainer"
                    yield text

            return train(read(), vocab_size)

        monkeypatch.setitem(tokenizer_module.TRAINERS, kind, counted)
    call = PreTrainedTokenizerBase.__call__

    def tokenised(self, text=None, *args, **kwargs):
        seen["tokenizer"] += [len(t) for t in ([text] if isinstance(text, str) else text or [])]
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", tokenised)
    return seen


def _prepare(recipe: str, tmp_path, files, cache_name="cache", **overrides):
    config = recipe_config_class(recipe)(
        train_data=[str(f) for f in files], max_seq_length=MAX_SEQ_LENGTH, eval_split_ratio=0, **overrides
    )
    return recipe_data(recipe)(config, tmp_path / cache_name, LOG)


def test_every_recipe_has_an_over_long_row_here():
    assert set(WRITERS) == set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_10_mb_row_is_left_out_of_tokenizer_training_counted_and_tokenised_from_a_head(
    recipe, tmp_path, monkeypatch
):
    write, row = WRITERS[recipe]
    normal, _ = write(tmp_path / "data", 60, 5, 0)
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps(row) + "\n")
    overrides = {"max_prompt_length": MAX_SEQ_LENGTH} if recipe == "grpo" else {}
    seen = _spy(monkeypatch)
    data = _prepare(recipe, tmp_path, [normal, big], **overrides)

    from tunebook.data.tokenize import longest_token_chars
    from tunebook.models.tokenizer import MAX_TOKEN_CHARS, tokenizer_max_chars

    bound = tokenizer_max_chars(LONGEST_TRAINED.get(recipe, MAX_SEQ_LENGTH))
    assert seen["trainer"] and max(seen["trainer"]) <= bound
    if recipe == "pretrain":  # documents are trained on whole: the tokenizer learns from all of it, in pieces
        assert sum(seen["trainer"]) > len(row["text"]) and "tokenizer_texts_overlong" not in data.stats
        assert data.stats["train_tokens_per_epoch"] > len(row["text"]) // MAX_TOKEN_CHARS
        return
    assert data.stats["tokenizer_texts_overlong"] == 1, data.stats
    # Tokenised from a head of at most twice the bound: twice max_seq_length x the tokenizer's longest token.
    assert max(seen["tokenizer"]) <= 2 * LONGEST_TRAINED.get(recipe, MAX_SEQ_LENGTH) * longest_token_chars(
        data.tokenizer
    )
    assert len(data.train) > 0


def test_other_examples_are_untouched_by_the_over_long_row(tmp_path, monkeypatch):
    """Dropped at max_seq_length, the row leaves the same tokenizer and the same prepared data as without it."""
    normal, _ = synthetic.write_synthetic_task(tmp_path / "data", 200, 5, 0)
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"text": BIG}) + "\n")
    alone = _prepare("sft", tmp_path, [normal], "cache-alone", overlong_examples="drop")
    _spy(monkeypatch)
    both = _prepare("sft", tmp_path, [normal, big], "cache-both", overlong_examples="drop")
    assert both.tokenizer.backend_tokenizer.to_str() == alone.tokenizer.backend_tokenizer.to_str()
    assert both.train[:] == alone.train[:]
    assert both.stats["dropped_overlong"] == alone.stats["dropped_overlong"] + 1
    assert both.stats["examples_read"] == alone.stats["examples_read"] + 1
    assert both.stats["tokenizer_texts_overlong"] == 1 and "tokenizer_texts_overlong" not in alone.stats
    # Under truncate the row is kept, cut to max_seq_length tokens: the tokens a whole tokenisation would start with.
    kept = _prepare("sft", tmp_path, [normal, big], "cache-both", overlong_examples="truncate")
    assert "tokenizer" not in kept.built and kept.stats["tokenizer_texts_overlong"] == 1  # reported when reused too
    cut = [ids for ids in kept.train["input_ids"] if len(ids) == MAX_SEQ_LENGTH]
    assert len(cut) == 1
    assert cut[0] == kept.tokenizer(BIG[:100_000])["input_ids"][:MAX_SEQ_LENGTH]


def test_cut_overlong_keeps_the_first_tokens_and_never_cuts_a_text_that_fits(tiny_tokenizer):
    from tunebook.data.tokenize import cut_overlong

    words = " ".join(f"hello world {i}, what is two plus two?\nfour." for i in range(5_000))  # ~250,000 characters
    short = "hello world " * 20
    for max_tokens in (64, 1000):
        texts = cut_overlong(tiny_tokenizer, [short, words], max_tokens)
        assert texts[0] == short and words.startswith(texts[1]) and len(texts[1]) < len(words) // 4
        head, whole = (tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in (texts[1], words))
        assert len(head) > max_tokens and head == whole[: len(head)]  # cut where the whole is split: exact
    # A tokenizer that drops whitespace fits this long text in two tokens: it is not cut.
    encoder = train_encoder_tokenizer(["a b c hello world"] * 10, vocab_size=60)
    spaced = "a" + " " * 100_000 + "b"
    assert cut_overlong(encoder, [spaced], 8) == [spaced]


def test_the_trained_tokenizer_cap_changes_nothing_on_ordinary_text_and_bounds_a_run(monkeypatch):
    from tunebook.data.tokenize import longest_token_chars
    from tunebook.models.tokenizer import MAX_TOKEN_CHARS

    ordinary = [json.dumps(synthetic.make_example(random.Random(i))) for i in range(500)]
    ordinary += ["The quick brown fox jumps over the lazy dog. " * 3, "0123456789 " * 5]
    capped = train_chat_tokenizer(ordinary, 512)
    monkeypatch.setattr(tokenizer_module, "MAX_TOKEN_CHARS", None)  # as trained before the cap
    uncapped = train_chat_tokenizer(ordinary, 512)
    assert capped.backend_tokenizer.to_str() == uncapped.backend_tokenizer.to_str()
    run = ordinary + ["b" * 5_000]
    assert longest_token_chars(train_chat_tokenizer(run, 512)) > MAX_TOKEN_CHARS
    monkeypatch.undo()
    assert longest_token_chars(train_chat_tokenizer(run, 512)) <= MAX_TOKEN_CHARS


def test_text_pieces_cut_long_documents_at_spaces_and_lose_nothing():
    from tunebook.models.tokenizer import text_pieces

    document = " ".join(f"word{i}" for i in range(3_000))
    pieces = list(text_pieces(["short", document, "x" * 250], 100))
    assert pieces[0] == "short" and "".join(pieces[1:-3]) == document and pieces[-3:] == ["x" * 100] * 2 + ["x" * 50]
    assert all(len(p) <= 100 for p in pieces) and all(p.startswith(" ") for p in pieces[2:-3])
