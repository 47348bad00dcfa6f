"""Prompt data for online RL (GRPO): sources -> tokenised prompts, with every other column kept for the rewards.

Each row needs a `prompt`: text (one user turn) or a list of messages (a system turn, earlier turns, a last user
turn), TRL's prompt-only format. Every other column (`answer`, `solution`, test cases, ...) travels with the prompt
to the reward functions untouched. `prompt_ids` is the prompt rendered with the chat template and its generation
prompt (the assistant turn's opening), so completions are exactly what an assistant turn holds.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch

from ..data.cache import PREPROCESSING_VERSION, fingerprint, tokenizer_fingerprint
from ..data.formats import as_messages
from ..data.pipeline import Pipeline, PreparedData, Tokenised
from ..data.sources import DataSource, fingerprint_sources, load_source
from ..data.synthetic import _write_disjoint, make_example
from ..data.tokenize import cut_overlong, longest_token_chars, render_chat, tokenize_conversations
from ..errors import DataError
from ..models.tokenizer import CHATML_TEMPLATE, setup_chat_template
from .environments import tool_definitions

__all__ = [
    "PromptData",
    "PromptPipeline",
    "PromptRows",
    "load_prompts",
    "prepare_text_prompt_data",
    "reference_examples",
    "reward_inputs",
    "write_multiplication_prompts",
    "write_synthetic_prompts",
]

# Columns this module adds; everything else in a row is the user's and goes to the reward functions.
PROMPT_COLUMNS = ("prompt_ids", "row")


@dataclass(kw_only=True)
class PromptData(PreparedData):
    """The prepared data of a GRPO run: `train` has prompt_ids, row (its index, which seeds its completions) and the
    source's columns."""


def prepare_text_prompt_data(config, cache_dir: Path, log: logging.Logger) -> PromptData:
    """Sources -> tokenizer -> tokenised train and eval prompts, each from the cache when unchanged (`GRPOConfig`).
    What a text model's run prepares (`tunebook.rl.prepare_prompt_data` chooses)."""
    return PromptPipeline(config, cache_dir, log).prepare()


class PromptPipeline(Pipeline):
    """Prompts' steps: prompts rendered with the chat template's generation prompt and tokenised, every other column
    kept; a seeded held-out split; train rows numbered by their position."""

    def write_synthetic(self, directory, num_train, num_eval, seed):
        if self.config.synthetic_task == "multiplication":
            return write_multiplication_prompts(directory, num_train, num_eval, seed)
        return write_synthetic_prompts(directory, num_train, num_eval, seed)

    def make_tokenizer(self):
        config = self.config
        tools = _tools_text(config)
        texts = lambda: _texts(self.train_sources, self.cache_dir, config, tools)  # noqa: E731
        key = fingerprint_sources(self.train_sources) + (fingerprint({"tools": tools}) if tools else "")
        # A text holds a prompt (trained up to max_prompt_length tokens) and its reference answer (the SFT warm-up's).
        tokenizer = self.trained_tokenizer(key, texts, config.max_prompt_length + config.max_seq_length)
        return setup_chat_template(tokenizer, config.chat_template, config.trust_remote_code, self.log)

    def tokenise(self, sources: list[DataSource], name: str) -> Tokenised:
        config, log = self.config, self.log
        key = fingerprint(
            {"prompts": fingerprint_sources(sources), "tokenizer": tokenizer_fingerprint(self.tokenizer),
             "max_prompt_length": config.max_prompt_length, "version": PREPROCESSING_VERSION}
        )  # fmt: skip
        build = lambda scratch: _build(sources, self.tokenizer, config, self.cache_dir, scratch)  # noqa: E731
        dataset, stats, cached = self.cached(key, build, f"{name} tokenisation")
        log.info("%s prompts: %d (%s); %s", name, len(dataset), "cached" if cached else "tokenised", stats)
        if stats["dropped"]:
            log.warning("%s prompts: %d longer than max_prompt_length=%d dropped", name, stats["dropped"],
                        config.max_prompt_length)  # fmt: skip
        return Tokenised(dataset, key, dict(stats))

    def split(self, train: Tokenised) -> tuple[Tokenised, Tokenised]:
        parts = train.dataset.train_test_split(test_size=self.config.eval_split_ratio, seed=self.config.seed)
        return train._replace(dataset=parts["train"]), Tokenised(parts["test"], train.key, {})

    def finish(self, train: Tokenised, evaluation: Tokenised | None) -> PromptData:
        # `row` seeds a prompt's completions: its position in the split, whatever the order of the loader.
        rows = train.dataset.remove_columns("row").add_column("row", list(range(len(train.dataset))))
        return PromptData(tokenizer=self.tokenizer, train=rows, eval=evaluation and evaluation.dataset,
                          stats={**train.stats, **self.notes})  # fmt: skip


def load_prompts(source: DataSource, cache_dir: Path, seed: int) -> datasets.Dataset:
    """A source's rows, checked to have a `prompt` and none of Tunebook's own columns."""
    raw = load_source(source, cache_dir, seed)
    if "prompt" not in raw.column_names:
        raise DataError(f"{source.where}: prompt data needs a 'prompt' column (text, or a list of messages); found "
                        f"{raw.column_names} (rename with {{path: ..., columns: {{old: prompt}}}})")  # fmt: skip
    clash = [c for c in PROMPT_COLUMNS if c in raw.column_names]
    if clash:
        raise DataError(f"{source.where}: column(s) {clash} are Tunebook's own; rename them")
    return raw


def _texts(sources: list[DataSource], cache_dir: Path, config, tools: str | None = None):
    """Prompts and reference answers (and warm-up completions, the tools' definitions) as text, to train a tokenizer
    on."""
    for source in sources:
        for number, row in enumerate(load_prompts(source, cache_dir, config.seed), 1):
            messages = as_messages(row["prompt"], "user", f"{source.where}, row {number}")
            reference = row.get(config.reference_column)
            completion = _completion_texts(row.get("completion"))  # a warm-up's tool calls and results, as text
            answer = [str(reference)] if reference is not None else []
            yield "\n".join([m["content"] for m in messages] + completion + answer + ([tools] if tools else []))


def _tools_text(config) -> str | None:
    """With tools, their definitions as the default chat template renders them into every episode's prompt: a
    tokenizer trained on them too writes that prompt in fewer tokens."""
    if not getattr(config, "tools", None):
        return None
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered = render_jinja_template([[{"role": "user", "content": ""}]], tools=tool_definitions(config.tools),
                                     chat_template=CHATML_TEMPLATE)  # fmt: skip
    return rendered[0][0]


def _completion_texts(completion) -> list[str]:
    if not isinstance(completion, list):
        return [completion] if isinstance(completion, str) else []
    texts = []
    for message in completion:
        texts.append(str(message.get("content") or ""))
        texts += [json.dumps(call.get("function", call)) for call in message.get("tool_calls") or []]
    return texts


def _build(sources: list[DataSource], tokenizer, config, cache_dir: Path, scratch: Path):
    parts = []
    for source in sources:
        raw = load_prompts(source, cache_dir, config.seed)
        parts.append(
            raw.map(
                _tokenize_prompts, batched=True, with_indices=True,
                fn_kwargs={"tokenizer": tokenizer, "max_prompt_length": config.max_prompt_length,
                           "where": source.where, "token_chars": longest_token_chars(tokenizer)},
                cache_file_name=str(scratch / f"prompts-{len(parts)}.arrow"), desc=f"Tokenising {Path(source.path).name}",
            )
        )  # fmt: skip
    dataset = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    read = len(dataset)
    dataset = dataset.filter(lambda keep: keep, input_columns="keep", cache_file_name=str(scratch / "kept.arrow"))
    if len(dataset) == 0:
        raise DataError(f"no prompt of {', '.join(s.path for s in sources)} fits max_prompt_length "
                        f"({config.max_prompt_length} tokens)")  # fmt: skip
    dataset = dataset.remove_columns("keep").add_column("row", list(range(len(dataset))))
    return dataset, {"prompts_read": read, "dropped": read - len(dataset), "prompts_kept": len(dataset)}


def _tokenize_prompts(batch: dict[str, list], indices: list[int], *, tokenizer, max_prompt_length: int,
                      where: str, token_chars: int) -> dict[str, list]:  # fmt: skip
    ids, keep = [], []
    for prompt, index in zip(batch["prompt"], indices):
        messages = as_messages(prompt, "user", f"{where}, row {index + 1}")
        if messages[-1]["role"] == "assistant":
            raise DataError(f"{where}, row {index + 1}: the prompt ends with an assistant turn; GRPO generates that "
                            "turn (put the answer in another column, e.g. 'answer')")  # fmt: skip
        text = render_chat(tokenizer, messages, generation_prompt=True)
        # A prompt too long to keep is tokenised from its head, which is too long too (`cut_overlong`).
        text = cut_overlong(tokenizer, [text], max_prompt_length, token_chars)[0]
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.append(tokens)
        keep.append(len(tokens) <= max_prompt_length)
    return {"prompt_ids": ids, "keep": keep}


def reference_examples(prompts: datasets.Dataset, tokenizer, reference_column: str, max_seq_length: int,
                       tools: list[dict] | None = None):  # fmt: skip
    """SFT examples (input_ids, labels on the answer) of the prompts with their reference answers: what an SFT
    warm-up trains on before GRPO, so the model first learns the answer format. Where the data has a `completion`
    column (text, or messages: assistant turns with tool calls, tool results, the answer), the loss is on its
    assistant turns instead, with the `tools` definitions rendered into the prompt, as an episode's is."""
    completion = "completion" in prompts.column_names
    if not completion and reference_column not in prompts.column_names:
        raise DataError(f"an SFT warm-up needs the reference answers (column {reference_column!r}; found "
                        f"{prompts.column_names}); set reference_column, or sft_warmup_steps 0")  # fmt: skip

    def conversations(batch):
        rows = []
        answers = batch["completion"] if completion else batch[reference_column]
        for prompt, answer in zip(batch["prompt"], answers):
            messages = as_messages(prompt, "user", "prompt data")  # context: the loss is on the answer only
            answer = as_messages(answer if completion else str(answer), "assistant", "prompt data", "completion")
            rows.append(json.dumps({"messages": messages + answer, "completion_start": len(messages),
                                    **({"tools": tools} if tools else {})}))  # fmt: skip
        return tokenize_conversations({"conversation": rows}, tokenizer=tokenizer, max_seq_length=max_seq_length,
                                      overlong="truncate", assistant_only_loss=True)  # fmt: skip

    examples = prompts.map(conversations, batched=True, remove_columns=prompts.column_names, keep_in_memory=True)
    return examples.filter(lambda keep: keep, input_columns="keep", keep_in_memory=True).select_columns(
        ["input_ids", "labels"]
    )


def reward_inputs(batch: dict[str, Any], completions: list[list[int]], repeat: int = 1,
                  episodes=None) -> tuple[list, dict]:  # fmt: skip
    """(prompts, columns) for the reward functions from a `PromptRows` batch whose prompts each have `repeat`
    consecutive completions: every column but ours, each value repeated, and `completion_lengths` (tokens). A
    `VisionPromptRows` batch's `images` are each prompt's resolved image paths; its pixels stay out. Multi-turn
    `episodes` (`tunebook.rl.episodes.Episodes`) add `messages` (each whole episode) and count only the model's
    tokens in `completion_lengths`."""
    columns = {k: [v for v in values for _ in range(repeat)] for k, values in batch.items()
               if k not in ("prompt", "image_inputs", *PROMPT_COLUMNS)}  # fmt: skip
    columns["completion_lengths"] = [len(c) for c in completions]
    if episodes is not None:
        columns["completion_lengths"], columns["messages"] = episodes.model_lengths(), episodes.messages
    return [p for p in batch["prompt"] for _ in range(repeat)], columns


class PromptRows:
    """Collate prompt rows as they are: `prompt_ids` and every other column as lists (the rewards' inputs)."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = {k: [f[k] for f in features] for k in features[0]}
        batch["row"] = torch.tensor(batch["row"], dtype=torch.long)
        return batch


def make_prompt(rng: random.Random) -> dict[str, str]:
    """A digit-task prompt and its answer (the SFT default's task as prompt-only data)."""
    example = make_example(rng)
    return {"prompt": f"{example['instruction']}\n{example['input']}", "answer": example["output"]}


def make_multiplication_prompt(rng: random.Random, tool_fraction: float = 0.7) -> dict[str, Any]:
    """A product of two 3-digit numbers, and a warm-up completion: for `tool_fraction` of the rows a call to the
    `calculator` tool, its result and the answer; for the others the answer alone, which a tiny model cannot compute,
    so GRPO has the tool's use to reward (the tools default, recipes/configs/grpo/tools_default.yaml)."""
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    answer = str(a * b)
    completion = [{"role": "assistant", "content": answer}]
    if rng.random() < tool_fraction:
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}}
        completion = [{"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "name": "calculator", "content": answer}, *completion]  # fmt: skip
    return {"prompt": f"Multiply.\n{a}*{b}", "answer": answer, "completion": completion}


def write_multiplication_prompts(directory: str | Path, num_train: int, num_eval: int, seed: int):
    """Write disjoint `train.jsonl`/`eval.jsonl` of multiplication prompts (`make_multiplication_prompt`)."""
    directory = Path(directory) / f"multiplication-{num_train}-{num_eval}-seed{seed}"
    return _write_disjoint(directory, num_train, num_eval, seed, make_multiplication_prompt, "prompt")


def write_synthetic_prompts(directory: str | Path, num_train: int, num_eval: int, seed: int):
    """Write disjoint `train.jsonl`/`eval.jsonl` of digit-task prompts with answers; returns their paths."""
    directory = Path(directory) / f"prompts-{num_train}-{num_eval}-seed{seed}"
    return _write_disjoint(directory, num_train, num_eval, seed, make_prompt, "prompt")
