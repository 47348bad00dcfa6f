"""Preference pairs for DPO and reward models: (prompt, chosen, rejected) rows rendered with the chat template,
tokenised, cached.

Explicit prompts: a `prompt` column holds a string (one user message) or a list of chat messages; `chosen` and
`rejected` hold a string (one assistant message), a list of response messages, or a whole conversation that repeats
the prompt first (as UltraFeedback-binarized does), whose repeated turns are dropped. Implicit prompts (no `prompt`
column, as in HH-RLHF and UltraFeedback-binarized): `chosen` and `rejected` are whole conversations, and the prompt
is their longest shared run of first messages. String transcripts ("Human: ... Assistant: ...") are not guessed at.
Messages follow `tunebook.data.formats` (content parts, tool calls, a `tools` column). Each pair becomes
`chosen_input_ids/labels` and `rejected_input_ids/labels`: the prompt rendered with the generation prompt, then the
response's own tokens, which alone carry labels. An optional numeric `margin` column (how much better the chosen
response is, for a reward model's loss) is kept as `margin`.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from ..data.cache import PREPROCESSING_VERSION, fingerprint, tokenizer_fingerprint
from ..data.formats import as_messages, normalise_messages
from ..data.pipeline import Pipeline, PreparedData, Tokenised
from ..data.sources import DataSource, fingerprint_sources, load_source
from ..data.synthetic import _write_disjoint, make_example
from ..data.tokenize import (
    IGNORE_INDEX,
    check_messages_rendered,
    check_turn_rendered,
    cut_overlong,
    longest_token_chars,
    render_chat,
)
from ..errors import DataError
from ..models.tokenizer import setup_chat_template

__all__ = [
    "PreferenceData",
    "PreferencePipeline",
    "encode_texts",
    "held_out_pairs",
    "prepare_preference_data",
    "prompt_and_response",
    "prompt_and_response_ids",
    "prompt_and_response_texts",
    "tokenize_pairs",
    "write_synthetic_preferences",
]

PAIR_COLUMNS = ("chosen", "rejected")  # and an optional prompt and margin


@dataclass(kw_only=True)
class PreferenceData(PreparedData):
    """The prepared data of a DPO or reward model run: tokenised pairs."""

    keys: dict[str, str]  # cache keys of the tokenised splits (reference log-probabilities are cached under them)


def prepare_preference_data(config, cache_dir: Path, log: logging.Logger) -> PreferenceData:
    """Sources -> tokenizer -> tokenised train and eval pairs, each from the cache when unchanged (`DPOConfig`)."""
    return PreferencePipeline(config, cache_dir, log).prepare()


class PreferencePipeline(Pipeline):
    """Preference pairs' steps: pairs rendered with the chat template and tokenised; a seeded held-out split whose
    keys name it (the reference log-probabilities are cached under them)."""

    def write_synthetic(self, directory, num_train, num_eval, seed):
        return write_synthetic_preferences(directory, num_train, num_eval, seed)

    def make_tokenizer(self):
        config = self.config
        texts = lambda: _texts(self.train_sources, self.cache_dir, config.seed)  # noqa: E731
        # A pair's text holds its prompt once and both responses: up to twice max_seq_length tokens of a pair that
        # fits.
        tokenizer = self.trained_tokenizer(fingerprint_sources(self.train_sources), texts, 2 * config.max_seq_length)
        return setup_chat_template(tokenizer, config.chat_template, config.trust_remote_code, self.log)

    def tokenise(self, sources: list[DataSource], name: str) -> Tokenised:
        return tokenise_cached(self, sources, name, "pairs", "pairs-margin", _build)

    def split(self, train: Tokenised) -> tuple[Tokenised, Tokenised]:
        return held_out_pairs(train, self.config.eval_split_ratio, self.config.seed)

    def finish(self, train: Tokenised, evaluation: Tokenised | None) -> PreferenceData:
        keys = {"train": train.key, **({"eval": evaluation.key} if evaluation else {})}
        return PreferenceData(tokenizer=self.tokenizer, train=train.dataset, eval=evaluation and evaluation.dataset,
                              keys=keys, stats={**train.stats, **self.notes})  # fmt: skip


def tokenise_cached(pipeline: Pipeline, sources: list[DataSource], name: str, unit: str, version: str, build):
    """`sources` tokenised by `build(sources, tokenizer, config, cache_dir, scratch)` into the pipeline's cache,
    keyed by the sources, the tokenizer and the length settings (`version` names the layout); logged in `unit`s
    (pairs, KTO's rows), with a warning for those cut or dropped at max_seq_length."""
    config, log = pipeline.config, pipeline.log
    key = fingerprint(
        {unit: fingerprint_sources(sources), "tokenizer": tokenizer_fingerprint(pipeline.tokenizer),
         "max_seq_length": config.max_seq_length, "overlong": config.overlong_examples,
         "version": f"{version}-{PREPROCESSING_VERSION}"}
    )  # fmt: skip
    dataset, stats, cached = pipeline.cached(
        key,
        lambda scratch: build(sources, pipeline.tokenizer, config, pipeline.cache_dir, scratch),
        f"{name} tokenisation",
    )
    log.info("%s %s: %d (%s); %s", name, unit, len(dataset), "cached" if cached else "tokenised", stats)
    if stats["truncated"] or stats["dropped"]:
        log.warning("%s %s: %d truncated and %d dropped at max_seq_length=%d", name, unit,
                    stats["truncated"], stats["dropped"], config.max_seq_length)  # fmt: skip
    return Tokenised(dataset, key, dict(stats))


def held_out_pairs(train: Tokenised, ratio: float, seed: int) -> tuple[Tokenised, Tokenised]:
    """(train, eval): a seeded share `ratio` of the pairs held out; the keys name the split, so reference
    log-probabilities cached under them belong to these very pairs."""
    parts = train.dataset.train_test_split(test_size=ratio, seed=seed)
    return (Tokenised(parts["train"], f"{train.key}-rest{ratio}-{seed}", train.stats),
            Tokenised(parts["test"], f"{train.key}-split{ratio}-{seed}", {}))  # fmt: skip


def _texts(sources: list[DataSource], cache_dir: Path, seed: int):
    """Every prompt and response as text, to train a tokenizer on."""
    for source in sources:
        for number, row in enumerate(_load_pairs(source, cache_dir, seed), 1):
            prompt, chosen, rejected, _ = preference_pair(row, f"{source.where}, row {number}")
            yield "\n".join(m["content"] for m in prompt + chosen + rejected)


def _load_pairs(source: DataSource, cache_dir: Path, seed: int) -> datasets.Dataset:
    raw = load_source(source, cache_dir, seed)
    missing = [c for c in PAIR_COLUMNS if c not in raw.column_names]
    if missing:
        raise DataError(f"{source.where}: preference data needs columns chosen and rejected (and prompt, or "
                        f"conversations that share their first turns); missing {missing} (found "
                        f"{raw.column_names}; rename with {{path: ..., columns: {{old: new}}}})")  # fmt: skip
    return raw


def _build(sources: list[DataSource], tokenizer, config, cache_dir: Path, scratch: Path):
    parts = []
    for source in sources:
        raw = _load_pairs(source, cache_dir, config.seed)
        parts.append(
            raw.map(
                tokenize_pairs, batched=True, with_indices=True, remove_columns=raw.column_names,
                fn_kwargs={"tokenizer": tokenizer, "max_seq_length": config.max_seq_length,
                           "overlong": config.overlong_examples, "where": source.where,
                           "token_chars": longest_token_chars(tokenizer)},
                cache_file_name=str(scratch / f"pairs-{len(parts)}.arrow"), desc=f"Tokenising {Path(source.path).name}",
            )
        )  # fmt: skip
    if any("margin" in part.column_names for part in parts):  # a source without margins: its pairs get 0
        parts = [p if "margin" in p.column_names else p.add_column("margin", [0.0] * len(p)) for p in parts]
    dataset = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    read = len(dataset)
    truncated = sum(dataset["truncated"])
    dataset = dataset.filter(lambda keep: keep, input_columns="keep", cache_file_name=str(scratch / "kept.arrow"))
    if len(dataset) == 0:
        raise DataError(f"no preference pair of {', '.join(s.path for s in sources)} fits max_seq_length")
    stats = {"pairs_read": read, "truncated": truncated, "dropped": read - len(dataset), "pairs_kept": len(dataset)}
    return dataset.remove_columns(["keep", "truncated"]), stats


def preference_pair(
    row: dict[str, Any], where: str, image_parts: bool = False
) -> tuple[list[dict], list[dict], list[dict], list | None]:
    """(prompt, chosen response, rejected response, tools) of one row, as message lists (module docstring); with
    `image_parts` (pairs with images, `tunebook.preference.vision_data`) contents stay lists of parts."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    for side, response in (("chosen", chosen), ("rejected", rejected)):
        if response is None:  # a row without the key: datasets fills the column in with null
            raise DataError(f"{where}: no '{side}' response (the row has no '{side}' column, or it is null)")
    if row.get("prompt") is not None:
        prompt = as_messages(row["prompt"], "user", where, "prompt", image_parts=image_parts)
        chosen, rejected = (_response(row[side], prompt, side, where, image_parts) for side in ("chosen", "rejected"))
    else:
        if isinstance(chosen, str) or isinstance(rejected, str):
            raise DataError(
                f"{where}: chosen/rejected are text and there is no prompt column; a prompt is not guessed from a "
                "transcript: give chosen and rejected as message lists (their shared first turns become the "
                "prompt), or add a prompt column"
            )
        chosen = normalise_messages(chosen, where, image_parts=image_parts)
        rejected = normalise_messages(rejected, where, image_parts=image_parts)
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not prompt or not chosen or not rejected:
            what = "share no first turn (no prompt)" if not prompt else "are the same conversation"
            raise DataError(f"{where}: chosen and rejected {what}")
    for side, response in (("chosen", chosen), ("rejected", rejected)):
        if response[0]["role"] != "assistant":
            raise DataError(f"{where}: the {side} response starts with a {response[0]['role']} turn, not the "
                            "assistant's; the prompt must be everything before the responses")  # fmt: skip
    tools = row.get("tools")
    return prompt, chosen, rejected, (json.loads(tools) if isinstance(tools, str) else tools)


def prompt_and_response(prompt: Any, response: Any, where: str) -> tuple[list[dict], list[dict]]:
    """One prompt and one response, in any form a pair's `prompt` and `chosen` take, as message lists: what a
    reward model scores."""
    prompt = as_messages(prompt, "user", where)
    return prompt, _response(response, prompt, "response", where)


def _response(value: Any, prompt: list[dict], side: str, where: str, image_parts: bool = False) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": [{"type": "text", "text": value}] if image_parts else value}]
    messages = normalise_messages(value, where, image_parts=image_parts)
    if messages[: len(prompt)] == prompt and len(messages) > len(prompt):
        return messages[len(prompt) :]  # a whole conversation that repeats the prompt
    if messages[0]["role"] != "assistant":
        raise DataError(f"{where}: {side} is a conversation whose first turns differ from the prompt; give the "
                        "responses only, or conversations that repeat the prompt exactly")  # fmt: skip
    return messages


def tokenize_pairs(batch: dict[str, list], indices: list[int], *, tokenizer, max_seq_length: int, overlong: str,
                   where: str, token_chars: int | None = None) -> dict[str, list]:  # fmt: skip
    """Batched `datasets.map` function: rows of prompt/chosen/rejected -> token ids and labels of both responses.

    The prompt is rendered with the generation prompt and the response is the rest of the full conversation's
    rendering, tokenised separately (as TRL does), so the split between them never falls inside a token. A text too
    long to fit is tokenised from its head (`cut_overlong`).
    """
    out: dict[str, list] = {k: [] for k in ("chosen_input_ids", "chosen_labels", "rejected_input_ids",
                                            "rejected_labels", "keep", "truncated")}  # fmt: skip
    columns = list(batch)
    if "margin" in columns:
        out["margin"] = []
    texts = []  # per row: the prompt, the chosen rest, the rejected rest; tokenised in one call for the batch
    for i, row in enumerate(indices):
        where_row = f"{where}, row {row + 1}"
        prompt, chosen, rejected, tools = preference_pair({c: batch[c][i] for c in columns}, where_row)
        if "margin" in columns:
            out["margin"].append(_margin(batch["margin"][i], where_row))
        prompt_text, rests = prompt_and_response_texts(tokenizer, prompt, (chosen, rejected), tools, where_row)
        texts += [prompt_text, *rests]
    ids = encode_texts(tokenizer, cut_overlong(tokenizer, texts, max_seq_length, token_chars))
    for prompt_ids, *responses in zip(ids[::3], ids[1::3], ids[2::3]):
        keep, cut = len(prompt_ids) < max_seq_length, False
        for side, response_ids in zip(("chosen", "rejected"), responses):
            room = max_seq_length - len(prompt_ids)
            if len(response_ids) > room:
                cut = True
                keep = keep and overlong == "truncate"
                response_ids = response_ids[: max(room, 0)]
            out[f"{side}_input_ids"].append(prompt_ids + response_ids)
            out[f"{side}_labels"].append([IGNORE_INDEX] * len(prompt_ids) + response_ids)
        out["keep"].append(keep)
        out["truncated"].append(cut and keep)
    return out


def prompt_and_response_texts(tokenizer, prompt: list[dict], responses, tools, where: str) -> tuple[str, list[str]]:
    """(the prompt's text, each response's text): the prompt rendered with the generation prompt, and each response
    the rest of the full conversation's rendering. Tokenised separately (as TRL does), the split between them never
    falls inside a token."""
    try:
        prompt_text = render_chat(tokenizer, prompt, tools, generation_prompt=True)
        full_texts = [render_chat(tokenizer, prompt + response, tools) for response in responses]
        for text, response in zip(full_texts, responses):
            check_messages_rendered(text, prompt + response, tools)
            for message in (m for m in response if m["role"] == "assistant"):
                check_turn_rendered(text[len(prompt_text) :], message)
    except DataError as error:
        raise DataError(f"{where}: {error}") from None
    if not all(text.startswith(prompt_text) for text in full_texts):
        raise DataError(f"{where}: the chat template renders the prompt differently inside the full conversation; "
                        "cannot tell the response tokens apart (set chat_template)")  # fmt: skip
    return prompt_text, [t[len(prompt_text) :] for t in full_texts]


def prompt_and_response_ids(tokenizer, prompt: list[dict], responses, tools, where: str) -> tuple[list, list]:
    """(the prompt's token ids, each response's token ids), from `prompt_and_response_texts`."""
    prompt_text, rests = prompt_and_response_texts(tokenizer, prompt, responses, tools, where)
    prompt_ids, *response_ids = encode_texts(tokenizer, [prompt_text, *rests])
    return prompt_ids, response_ids


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """The ids of rendered texts (no special tokens added: the template wrote them), in one tokenizer call:
    transformers' per-call overhead dominated tokenising short pairs one text at a time."""
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def _margin(value: Any, where: str) -> float:
    """A row's margin: a finite number, or text that is one (CSV cells are read as text)."""
    number = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            pass
    if number is None or not math.isfinite(number):
        raise DataError(f"{where}: column 'margin' must hold a finite number, got {value!r:.100}")
    return number


def make_preference(rng: random.Random) -> dict[str, str]:
    """A digit-task pair: the right answer chosen; rejected, the digits unchanged or the answer with one digit
    changed (the mistakes a model that half-knows the task makes)."""
    example = make_example(rng)
    answer = example["output"]
    wrong = example["input"]
    if wrong == answer or rng.random() < 0.5:
        i = rng.randrange(len(answer))
        wrong = answer[:i] + rng.choice([d for d in "0123456789" if d != answer[i]]) + answer[i + 1 :]
    return {"prompt": f"{example['instruction']}\n{example['input']}", "chosen": answer, "rejected": wrong}


def write_synthetic_preferences(directory: str | Path, num_train: int, num_eval: int, seed: int):
    """Write disjoint `train.jsonl`/`eval.jsonl` of digit-task preference pairs; returns their paths."""
    directory = Path(directory) / f"preferences-{num_train}-{num_eval}-seed{seed}"
    return _write_disjoint(directory, num_train, num_eval, seed, make_preference, "prompt")
