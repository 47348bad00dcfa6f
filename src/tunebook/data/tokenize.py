"""Render conversations with the tokenizer's chat template, tokenise, and mask the loss to assistant turns.

Assistant spans (of a prompt/completion row, only the completion's: the prompt is context) are found as character
ranges of the rendered text: the span of turn i runs from the end of
`render(messages[:i], add_generation_prompt=True)` to the end of `render(messages[:i + 1])`, so it includes the
end-of-turn marker (the model must learn to stop). Tokens whose first character lies in a span carry loss.
This works for any chat template whose renderings of prefixes are prefixes of the whole, without requiring
`{% generation %}` markers that few real templates have. Tool calls are assistant turns and carry loss; tool
results are not. A plain-text example (`{"text": ...}`) carries loss on every token and ends with EOS.
"""

from __future__ import annotations

import bisect
import itertools
import json
import re
from typing import Any

from transformers import PreTrainedTokenizerBase

from ..errors import DataError, first_line

__all__ = [
    "IGNORE_INDEX",
    "assistant_spans",
    "cut_overlong",
    "format_loss_mask",
    "longest_token_chars",
    "render_chat",
    "tokenize_conversations",
    "turn_examples",
    "unstable_turn",
]

IGNORE_INDEX = -100
_WORD_END = re.compile(r"(?<=\S)[ \n]")  # a space or line break after a word: where pre-tokenizers split


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters of text one token of `tokenizer` stands for: its longest vocabulary entry. Byte-level
    entries spell one character per byte, at least as many as the characters they stand for; SentencePiece entries
    spell their text (a space as one ▁), WordPiece entries their piece of a word."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def cut_overlong(tokenizer, texts: list[str], max_tokens: int, token_chars: int | None = None) -> list[str]:
    """`texts`, each one too long to fit in `max_tokens` tokens cut to a head that still holds more than
    `max_tokens`: tokenising a 10 MB row then costs what its head costs, and truncating it keeps the same tokens.

    A text of more than `max_tokens * token_chars` characters (`token_chars`: `longest_token_chars`) holds more than
    `max_tokens` tokens wherever every character is spelled by some token (byte-level BPE, SentencePiece), so it
    cannot fit. Its head ends at the second word end (a space or line break after a word) past that length:
    pre-tokenizers split there, so the head's tokens up to its last word are the whole text's, and they already
    number more than `max_tokens`. (A text without two word ends in the next `max_tokens * token_chars` characters is
    cut inside a word, whose tokens at the cut may differ.) The head is used only if it holds more than `max_tokens`
    tokens, so a text that fits is never cut; one that fits only because the tokenizer drops characters (WordPiece
    drops whitespace) is tokenised whole, as before.
    """
    bound = max_tokens * (token_chars or longest_token_chars(tokenizer))
    long = [i for i, text in enumerate(texts) if len(text) > bound]
    if not long:
        return texts
    heads = {}
    for i in long:
        ends = [m.start() for m in itertools.islice(_WORD_END.finditer(texts[i], bound + 1, 2 * bound), 2)]
        heads[i] = texts[i][: ends[-1] if ends else bound + 1]
    counts = tokenizer([heads[i] for i in long], add_special_tokens=False)["input_ids"]
    cut = {i for i, ids in zip(long, counts) if len(ids) > max_tokens}
    return [heads[i] if i in cut else text for i, text in enumerate(texts)]


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools=None, generation_prompt=False) -> str:
    """`apply_chat_template` as text; a template that cannot render the conversation is a DataError."""
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as error:  # jinja2's TemplateError, or the template's own raise_exception(...)
        raise DataError(f"the chat template cannot render this conversation: {first_line(error)}") from None


def assistant_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list | None = None, first: int = 0
) -> tuple[str, list[tuple[int, int]]]:
    """Return the rendered text and the character spans of its assistant turns from message `first` on (the
    completion of a prompt/completion row: the prompt's assistant turns are context)."""
    text = render_chat(tokenizer, messages, tools)
    check_messages_rendered(text, messages, tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < first:
            continue
        before = render_chat(tokenizer, messages[:i], tools, generation_prompt=True) if i else ""
        through = text if i == len(messages) - 1 else render_chat(tokenizer, messages[: i + 1], tools)
        if not text.startswith(through):
            through = _without_closing(tokenizer, through, text)
        if not text.startswith(through):
            raise DataError(unstable_turn(i, through, text, "when it is the last message", "once others follow"))
        if not through.startswith(before):
            raise DataError(unstable_turn(i, before, through, "in the prompt that asks for it", "with it"))
        if len(through) > len(before):
            spans.append((len(before), len(through)))
            check_turn_rendered(text[len(before) : len(through)], message)
    return text, spans


def turn_examples(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list | None = None, first: int = 0
) -> list[tuple[str, list[tuple[int, int]]]]:
    """One (text, [span]) per assistant turn from message `first` on: the conversation up to and including the
    turn, rendered as the template renders it when that turn is the last, which is how the model sees it when
    generating it.

    For templates that render earlier turns differently once later turns follow (Qwen3 drops their reasoning,
    GPT-OSS ends them with <|end|> instead of <|return|>), where one rendering of the whole conversation cannot
    hold every turn as it is generated. A conversation of k turns costs about k times the tokens of its last one.
    """
    examples = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < first:
            continue
        before = render_chat(tokenizer, messages[:i], tools, generation_prompt=True) if i else ""
        through = render_chat(tokenizer, messages[: i + 1], tools)
        check_messages_rendered(through, messages[: i + 1], tools)
        if not through.startswith(before):
            raise DataError(unstable_turn(i, before, through, "in the prompt that asks for it", "with it"))
        if len(through) > len(before):
            check_turn_rendered(through[len(before) :], message)
            examples.append((through, [(len(before), len(through))]))
    # No assistant turn: one example without loss, counted and dropped as the whole-conversation path does.
    return examples or [(render_chat(tokenizer, messages, tools), [])]


def _without_closing(tokenizer, through: str, text: str) -> str:
    """`through` without the special token some templates close every rendering with (Phi-3's and Phi-4-mini's
    `eos_token` after the last message), where the whole conversation has it only at its end: the turn ends where
    the next one starts, with its own end-of-turn token. Anything else that differs is left for the caller to
    refuse (GPT-OSS ends its last turn with `<|return|>` instead of an earlier turn's `<|end|>`)."""
    stripped = through.rstrip()
    for token in tokenizer.all_special_tokens:
        if token and stripped.endswith(token) and text.rstrip().endswith(token):
            head = stripped[: -len(token)]
            if head.rstrip().endswith(tokenizer.eos_token or "\0") and text.startswith(head):
                return head
    return through


def unstable_turn(i: int, first: str, second: str, as_first: str, as_second: str) -> str:
    """Why a turn cannot be located: where two renderings that should share a prefix part."""
    at = next((k for k, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    return (
        f"the chat template renders the conversation differently around message {i + 1} (assistant), so its turn "
        f"cannot be located for the loss mask: {first[max(0, at - 20) : at + 30]!r} {as_first}, "
        f"{second[max(0, at - 20) : at + 30]!r} {as_second} (Qwen3's template drops the think block of earlier "
        "turns, GPT-OSS's ends them differently, DeepSeek-R1's prompt forces <think>). Use a template that renders "
        "every turn the same way (chat_template, e.g. TRL's qwen3_training.jinja), one example per assistant turn "
        "(split_turns: true), or assistant_only_loss: false"
    )


def check_messages_rendered(text: str, messages: list[dict[str, Any]], tools: list | None) -> None:
    """Templates drop what they do not support without a word (tool calls, tool definitions or results; Mistral's
    system prompt, which goes only into a final user turn): refuse a rendering that lost part of the conversation."""
    for message in messages:
        content = message.get("content")
        if message["role"] != "assistant" and isinstance(content, str) and not _rendered(content.strip(), text):
            raise DataError(
                f"the chat template does not render the {message['role']} message {content.strip()!r:.60}; set "
                "chat_template to a template that renders every message of the conversation"
            )
    names = [t.get("function", t).get("name") for t in tools or [] if isinstance(t.get("function", t), dict)]
    missing = [name for name in names if name and name not in text]
    if missing:
        raise DataError(
            f"the chat template does not render the tool definition {missing[0]!r:.60}; set chat_template to a "
            "template that supports tools"
        )


def _rendered(content: str, text: str) -> bool:
    """The content is in the text as written, or as a JSON string (Llama 3.1 renders tool results with `tojson`)."""
    return content in text or json.dumps(content, ensure_ascii=False)[1:-1] in text


def check_turn_rendered(turn: str, message: dict[str, Any]) -> None:
    """The assistant turn's own span holds its answer and every tool call (Granite 3 drops tool calls, GPT-OSS
    all but the first, Llama 3.1 the text beside a call)."""
    calls = [call["function"]["name"] for call in message.get("tool_calls") or []]
    missing = [name for name in calls if name not in turn]
    if missing:
        raise DataError(
            f"the chat template does not render the tool call {missing[0]!r:.60} in its assistant turn; set "
            "chat_template to a template that supports tools"
        )
    content = message.get("content")
    # What follows the reasoning: templates re-render `<think>...</think>` (Qwen3), but the answer is kept as written.
    answer = content.rsplit("</think>", 1)[-1].strip() if isinstance(content, str) else ""
    if answer and answer not in turn:
        raise DataError(
            f"the chat template does not render the assistant message {answer!r:.60} in its turn"
            f"{' beside its tool calls' if calls else ''}; set chat_template to a template that renders it"
        )


def tokenize_conversations(
    batch: dict[str, list[Any]],
    indices: list[int] | None = None,
    *,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    overlong: str,
    assistant_only_loss: bool,
    split_turns: bool = False,
    where: str = "data",
    origin: list[int] | None = None,
    first_id: int | None = None,
    token_chars: int | None = None,
) -> dict[str, list[Any]]:
    """Batched `datasets.map` function: `conversation` JSON rows -> input_ids, labels and bookkeeping columns.

    Columns: `input_ids`, `labels` (IGNORE_INDEX outside the loss), `prompt_length` (tokens before the last
    assistant turn, for generation eval; 0 for plain text), `truncated`, and `keep` (False for rows to drop:
    over-long under `overlong="drop"`, or left with no loss-bearing token). Errors name the row (from 1).
    With `split_turns`, a conversation gives one example per assistant turn (see `turn_examples`); `origin`, if
    given, receives the batch position each output row came from, and with `first_id` a `conversation_id` column
    numbers the conversations from it (row index + first_id), so a held-out split can keep each one whole.
    A text too long to fit is tokenised from its head (`cut_overlong`, given `token_chars` or computing it).
    """
    texts, spans, rows = [], [], []  # per output row: the text to tokenise; its assistant spans; its input row
    for position, row in enumerate(batch["conversation"]):
        example = json.loads(row)
        if "text" in example:
            pieces = [(example["text"], None)]
        else:
            messages, tools = example["messages"], example.get("tools")
            first = example.get("completion_start", 0)  # prompt/completion rows: the loss is on the completion only
            try:
                if split_turns:
                    pieces = turn_examples(tokenizer, messages, tools, first)
                else:
                    pieces = [assistant_spans(tokenizer, messages, tools, first)]
            except DataError as error:
                row_number = indices[position] + 1 if indices is not None else position + 1
                raise DataError(f"{where}, row {row_number}: {error}") from None
        for text, turns in pieces:
            texts.append(text)
            spans.append(turns)
            rows.append(position)
    if origin is not None:
        origin.extend(rows)
    texts = cut_overlong(tokenizer, texts, max_seq_length, token_chars)
    encoded = _encode(tokenizer, texts, spans)
    out: dict[str, list[Any]] = {k: [] for k in ("input_ids", "labels", "prompt_length", "truncated", "keep")}
    for text, turns, (ids, offsets) in zip(texts, spans, encoded):
        if turns is None:  # plain text: loss on every token
            labels, prompt_length = list(ids), 0
        else:
            labels, prompt_length = _chat_labels(ids, offsets, turns, len(text), assistant_only_loss)
        truncated = len(ids) > max_seq_length
        keep = not (truncated and overlong == "drop")
        ids, labels = ids[:max_seq_length], labels[:max_seq_length]
        # Position 0 never carries loss (nothing predicts it), hence labels[1:].
        keep = keep and any(label != IGNORE_INDEX for label in labels[1:])
        for key, value in zip(out, (ids, labels, prompt_length, truncated, keep)):
            out[key].append(value)
    if first_id is not None:
        out["conversation_id"] = [first_id + (indices[r] if indices is not None else r) for r in rows]
    return out


def _encode(tokenizer, texts: list[str], spans: list) -> list[tuple[list[int], list | None]]:
    """(ids, character offsets) of every text, chat renderings without special tokens (the template wrote them),
    plain texts with them (BOS) and ending in EOS so the model learns to stop.

    One tokenizer call per kind for the whole batch, not one per row: the per-call overhead of transformers'
    tokenizer wrapper was ~40% of the time tokenising Code Alpaca's short examples.
    """
    chat = [i for i, turns in enumerate(spans) if turns is not None]
    plain = [i for i, turns in enumerate(spans) if turns is None]
    result: list = [None] * len(texts)
    if chat:
        enc = tokenizer([texts[i] for i in chat], add_special_tokens=False, return_offsets_mapping=True)
        for i, ids, offsets in zip(chat, enc["input_ids"], enc["offset_mapping"]):
            result[i] = (ids, offsets)
    if plain:
        eos = tokenizer.eos_token_id
        for i, ids in zip(plain, tokenizer([texts[i] for i in plain])["input_ids"]):
            result[i] = (ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids, None)
    return result


def _chat_labels(ids, offsets, spans, text_length: int, assistant_only_loss: bool) -> tuple[list[int], int]:
    """Labels (the ids of tokens starting inside an assistant span, or all ids) and the prompt length: the tokens
    before the last assistant turn."""
    starts = [start for start, _ in offsets]
    last = spans[-1][0] if spans else text_length
    if any(a > b for a, b in zip(starts, starts[1:])):  # not in text order (a normaliser that moves text): per token
        prompt_length = next((j for j, start in enumerate(starts) if start >= last), len(ids))
        if not assistant_only_loss:
            return list(ids), prompt_length
        labels = [t if any(a <= start < b for a, b in spans) else IGNORE_INDEX for t, start in zip(ids, starts)]
        return labels, prompt_length
    # In text order, each span's tokens are one slice: a per-token test was half of the tokenisation time.
    prompt_length = bisect.bisect_left(starts, last)
    if not assistant_only_loss:
        return list(ids), prompt_length
    labels = [IGNORE_INDEX] * len(ids)
    for a, b in spans:
        lo, hi = bisect.bisect_left(starts, a), bisect.bisect_left(starts, b)
        labels[lo:hi] = ids[lo:hi]
    return labels, prompt_length


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
