"""Tokenise a conversation with images for a vision-language model, and mask its loss to the assistant turns.

How many tokens a processor expands an image placeholder into depends only on the image's size (Qwen-VL: one per
28 x 28 pixels of the image as resized; LLaVA: a fixed count). So the real images are never decoded here: the
processor is called with the rendered text and BLANK images of the sizes `check_images` read from the headers, and
its `input_ids` are the exact ones training will see, for any family, without code per family.

The loss mask is found by render-and-compare on tokens, as `tunebook.data.tokenize` does on characters: the tokens
of `render(messages[:i], add_generation_prompt=True)` and of `render(messages[:i + 1])` (each with the images that
occur in that prefix) must be prefixes of the tokens of the whole conversation; the tokens between them are
assistant turn i with its end-of-turn marker, and carry the loss. Image tokens never do, nor anything else.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from PIL import Image

from .. import compat
from ..errors import DataError, first_line
from .cache import tokenizer_fingerprint
from .tokenize import IGNORE_INDEX, check_messages_rendered, check_turn_rendered, unstable_turn

__all__ = [
    "image_token_ids",
    "images_fingerprint",
    "processor_fingerprint",
    "tokenize_image_conversation",
    "tokenize_image_conversations",
    "tokenize_image_prompt_and_responses",
    "tokenize_image_prompt",
    "tokenise_cached",
]


def image_token_ids(processor) -> set[int]:
    """The ids of the tokens that stand for image content (`<|image_pad|>`, `<image>`): never labels."""
    return {i for i in processor.image_token_ids if i is not None}


def _render(processor, messages: list[dict], tools, generation_prompt: bool = False) -> str:
    try:
        return processor.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=processor.chat_template, tokenize=False,
            add_generation_prompt=generation_prompt,
        )  # fmt: skip
    except Exception as error:  # jinja2's TemplateError, or the template's own raise_exception(...)
        raise DataError(f"the chat template cannot render this conversation: {first_line(error)}") from None


def _count_images(messages: list[dict]) -> int:
    return sum(
        1 for m in messages if isinstance(m.get("content"), list) for p in m["content"] if p.get("type") == "image"
    )


def _ids(processor, text: str, sizes: list) -> list[int]:
    """The processor's input_ids of `text` with blank images of `sizes` ([width, height] each)."""
    blanks = [Image.new("RGB", (int(w), int(h))) for w, h in sizes]
    try:
        out = processor(text=[text], images=blanks or None, return_tensors=None)
    except (ValueError, TypeError, IndexError) as error:
        raise DataError(f"the processor cannot expand this conversation's images: {first_line(error)}") from None
    return list(out["input_ids"][0])


def _text_views(messages: list[dict]) -> list[dict]:
    """Each text part as a message of its own, which `check_messages_rendered` can look for in the rendering."""
    views = []
    for m in messages:
        content = m.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
        views += [{"role": m["role"], "content": p["text"]} for p in parts if p.get("type") == "text"]
    return views


def tokenize_image_conversation(
    processor, messages: list[dict], sizes: list, tools: list | None = None, first: int = 0,
    assistant_only_loss: bool = True,
) -> tuple[list[int], list[int], int]:  # fmt: skip
    """(input_ids, labels, prompt_length) of one conversation whose images have `sizes`, in placeholder order.

    Labels are the ids of the assistant turns from message `first` on (end of turn included), IGNORE_INDEX
    elsewhere; with `assistant_only_loss` false every token but the images' carries the loss. `prompt_length` is the
    number of tokens before the last assistant turn (the prompt of generation evaluation). A template whose
    renderings of prefixes are not prefixes of the whole is a DataError naming the turn.
    """
    text = _render(processor, messages, tools)
    check_messages_rendered(text, [v for v in _text_views(messages) if v["role"] != "assistant"], tools)
    ids = _ids(processor, text, sizes)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < first:
            continue
        before = _prefix_ids(processor, messages[:i], sizes, tools, True) if i else []
        through = ids if i == len(messages) - 1 else _prefix_ids(processor, messages[: i + 1], sizes, tools, False)
        decode = processor.tokenizer.decode
        if ids[: len(through)] != through:
            last, later = "when it is the last message", "once others follow"
            raise DataError(unstable_turn(i, decode(through), text, last, later))
        if through[: len(before)] != before:
            raise DataError(
                unstable_turn(i, decode(before), decode(through), "in the prompt that asks for it", "with it")
            )
        if len(through) > len(before):
            spans.append((len(before), len(through)))
            answer = "".join(v["content"] for v in _text_views([message]))
            check_turn_rendered(decode(through[len(before) :]), {**message, "content": answer})
    images = image_token_ids(processor)
    if assistant_only_loss:
        labels = [IGNORE_INDEX] * len(ids)
        for a, b in spans:
            labels[a:b] = ids[a:b]
    else:
        labels = list(ids)
    labels = [IGNORE_INDEX if t in images else label for t, label in zip(ids, labels)]
    return ids, labels, spans[-1][0] if spans else len(ids)


def tokenize_image_prompt(processor, messages: list[dict], sizes: list) -> list[int]:
    """The input_ids of a prompt (messages up to a last user turn) with its images of `sizes` and the chat template's
    generation prompt: what a model generates an assistant turn after (GRPO)."""
    return _ids(processor, _render(processor, messages, None, generation_prompt=True), sizes)


def _prefix_ids(processor, messages: list[dict], sizes: list, tools, generation_prompt: bool) -> list[int]:
    text = _render(processor, messages, tools, generation_prompt)
    return _ids(processor, text, sizes[: _count_images(messages)])


def tokenize_image_prompt_and_responses(
    processor, prompt: list[dict], responses: list[list[dict]], sizes: list, tools: list | None = None
) -> tuple[list[int], list[list[int]]]:
    """(the prompt's ids, each response's ids) of a preference pair whose images (of `sizes`) are in the prompt: the
    prompt rendered with the generation prompt, and each response the rest of the tokens of the whole conversation.

    The text path's split (`tunebook.preference.data.prompt_and_response_texts`) made on tokens: the prompt's tokens
    must be a prefix of every whole conversation's, so the chosen and rejected sequences share the prompt's tokens,
    its image tokens included, exactly. A template that renders the prompt differently once a response follows is a
    DataError.
    """
    prompt_text = _render(processor, prompt, tools, generation_prompt=True)
    prompt_ids = _ids(processor, prompt_text, sizes)
    rests = []
    for response in responses:
        text = _render(processor, prompt + response, tools)
        check_messages_rendered(text, [v for v in _text_views(prompt + response) if v["role"] != "assistant"], tools)
        ids = _ids(processor, text, sizes)
        if ids[: len(prompt_ids)] != prompt_ids:
            decode = processor.tokenizer.decode
            raise DataError(unstable_turn(len(prompt), decode(prompt_ids), text, "as the prompt", "with a response"))
        rest = ids[len(prompt_ids) :]
        for message in (m for m in response if m["role"] == "assistant"):
            answer = "".join(v["content"] for v in _text_views([message]))
            check_turn_rendered(processor.tokenizer.decode(rest), {**message, "content": answer})
        rests.append(rest)
    return prompt_ids, rests


def tokenize_image_conversations(
    batch: dict[str, list[Any]], *, processor, max_seq_length: int, overlong: str, assistant_only_loss: bool,
) -> dict[str, list[Any]]:  # fmt: skip
    """Batched `datasets.map` function over checked rows (`conversation`, `images`, `image_sizes`): adds
    `input_ids`, `labels`, `prompt_length`, `where` and the flags `truncated`, `image_cut` (the row is longer than
    `max_seq_length` and the cut would fall inside or before an image's tokens: dropped, since a row must hold the
    tokens of every image it brings) and `keep`. Errors name the row's file and row."""
    images = image_token_ids(processor)
    out: dict[str, list] = {k: [] for k in ("input_ids", "labels", "prompt_length", "truncated", "image_cut",
                                             "keep", "where")}  # fmt: skip
    for row, sizes in zip(batch["conversation"], batch["image_sizes"]):
        example = json.loads(row)
        where = example.get("where", "data")
        try:
            ids, labels, prompt_length = tokenize_image_conversation(
                processor, example["messages"], sizes, example.get("tools"), example.get("completion_start", 0),
                assistant_only_loss,
            )  # fmt: skip
        except DataError as error:
            raise DataError(f"{where}: {error}") from None
        truncated = len(ids) > max_seq_length
        image_cut = truncated and any(t in images for t in ids[max_seq_length:])
        keep = not image_cut and not (truncated and overlong == "drop")
        ids, labels = ids[:max_seq_length], labels[:max_seq_length]
        keep = keep and any(label != IGNORE_INDEX for label in labels[1:])  # position 0 is never predicted
        for key, value in zip(out, (ids, labels, min(prompt_length, len(ids)), truncated, image_cut, keep, where)):
            out[key].append(value)
    return out


def processor_fingerprint(processor) -> str:
    """Hash of what decides a processor's tokens: its tokenizer and chat template (`tokenizer_fingerprint`), and
    every setting of its image processor and of its own (image token counts, resize bounds, patch sizes)."""
    settings = processor.to_dict()
    settings.pop("tokenizer", None)
    blob = json.dumps({"settings": settings, "template": processor.chat_template}, sort_keys=True, default=str)
    return hashlib.sha256((tokenizer_fingerprint(processor.tokenizer) + blob).encode()).hexdigest()


def images_fingerprint(dataset) -> str:
    """Hash of a checked data set's image references (paths, or the bytes themselves) and their sizes as read from
    the headers now: an image replaced by one of another size changes it, so stale token counts are never reused."""
    h = hashlib.sha256()
    for column in ("images", "image_sizes"):
        h.update(column.encode())
        for chunk in dataset.data.column(column).chunks:
            for buffer in chunk.buffers():
                if buffer is not None:
                    h.update(buffer)
    indices = compat.indices_mapping(dataset)  # the rows kept when check_images skipped some
    if indices is not None:
        for chunk in indices.column(0).chunks:
            for buffer in chunk.buffers():
                if buffer is not None:
                    h.update(buffer)
    return h.hexdigest()


def tokenise_cached(checked, function, processor, features, config, key: str, scratch: Path, desc: str, **kwargs):
    """`checked.map(function)` of the rows with image references, batched, into `scratch/tokenised.arrow` under the
    cache entry's `key`: what the SFT and DPO vision pipelines share (`function` and `kwargs` are theirs)."""
    return checked.map(
        function,
        batched=True,
        batch_size=100,
        fn_kwargs={
            "processor": processor,
            "max_seq_length": config.max_seq_length,
            "overlong": config.overlong_examples,
            **kwargs,
        },  # fmt: skip
        remove_columns=["conversation"],
        features=features,
        num_proc=config.dataset_num_proc,
        cache_file_name=str(scratch / "tokenised.arrow"),
        new_fingerprint=key,  # not a hash of the processor, which datasets would pickle for every run
        desc=desc,
    )
