"""Render chat `messages` with the tokenizer's chat template, tokenise, and mask the loss to assistant turns.

Assistant spans are found as character ranges of the rendered text: the span of turn i runs from the end of
`render(messages[:i], add_generation_prompt=True)` to the end of `render(messages[:i + 1])`, so it includes the
end-of-turn marker (the model must learn to stop). Tokens whose first character lies in a span carry loss.
This works for any chat template whose renderings of prefixes are prefixes of the whole, without requiring
`{% generation %}` markers that few real templates have.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from ..errors import DataError

__all__ = ["IGNORE_INDEX", "assistant_spans", "format_loss_mask", "tokenize_conversations"]

IGNORE_INDEX = -100


def assistant_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]
) -> tuple[str, list[tuple[int, int]]]:
    """Return the rendered text and the character spans of its assistant turns."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise DataError(
                "the tokenizer's chat template renders a conversation's prefix differently from the whole "
                "conversation, so assistant turns cannot be located for the loss mask; use another template "
                "(set `chat_template` on the tokenizer) or assistant_only_loss: false"
            )
        if len(through) > len(before):
            spans.append((len(before), len(through)))
    return text, spans


def tokenize_conversations(
    batch: dict[str, list[Any]],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    overlong: str,
    assistant_only_loss: bool,
) -> dict[str, list[Any]]:
    """Batched `datasets.map` function: messages -> input_ids, labels and bookkeeping columns.

    Columns: `input_ids`, `labels` (IGNORE_INDEX outside the loss), `prompt_length` (tokens before the last
    assistant turn, for generation eval), `truncated`, and `keep` (False for rows to drop: over-long under
    `overlong="drop"`, or left with no loss-bearing token).
    """
    out: dict[str, list[Any]] = {k: [] for k in ("input_ids", "labels", "prompt_length", "truncated", "keep")}
    for messages in batch["messages"]:
        text, spans = assistant_spans(tokenizer, messages)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        in_span = [any(a <= start < b for a, b in spans) for start, _ in offsets]
        labels = [t if (m or not assistant_only_loss) else IGNORE_INDEX for t, m in zip(ids, in_span)]
        last = spans[-1][0] if spans else len(text)
        prompt_length = next((j for j, (start, _) in enumerate(offsets) if start >= last), len(ids))
        truncated = len(ids) > max_seq_length
        keep = not (truncated and overlong == "drop")
        ids, labels = ids[:max_seq_length], labels[:max_seq_length]
        # Position 0 never carries loss (nothing predicts it), hence labels[1:].
        keep = keep and any(label != IGNORE_INDEX for label in labels[1:])
        for key, value in zip(out, (ids, labels, prompt_length, truncated, keep)):
            out[key].append(value)
    return out


def format_loss_mask(tokenizer: PreTrainedTokenizerBase, input_ids: list[int], labels: list[int]) -> str:
    """Render one example for the log, with the loss-bearing text wrapped in [[...]]."""
    parts, current, inside = [], [], False
    for token, label in zip(input_ids, labels):
        masked = label != IGNORE_INDEX
        if masked != inside and current:
            piece = tokenizer.decode(current)
            parts.append(f"[[{piece}]]" if inside else piece)
            current = []
        inside = masked
        current.append(token)
    if current:
        piece = tokenizer.decode(current)
        parts.append(f"[[{piece}]]" if inside else piece)
    return "".join(parts)
