"""Unpaired preference rows for KTO: (prompt, completion, label) rendered with the chat template, tokenised, each
with its mismatched KL row, cached.

Two formats, told apart by a source's columns:
- unpaired, TRL's: `prompt`, `completion` and `label` (true: desirable, false: undesirable); `prompt` and
  `completion` take the forms a pair's `prompt` and `chosen` take (`tunebook.preference.data`);
- paired, what the DPO recipe reads (`prompt`/`chosen`/`rejected`, or conversations sharing their first turns):
  each pair becomes a desirable row (its chosen response) and an undesirable one (its rejected response), as TRL's
  `unpair_preference_dataset` splits them.

Each row becomes `input_ids`/`labels` (the prompt rendered with the generation prompt, then the completion's own
tokens, which alone carry labels), `label`, and `kl_input_ids`/`kl_labels`: the same prompt with the completion of
another row (`mismatched_partners`), whose log-ratio estimates the KL term. TRL forms those mismatched pairs inside
each batch of a sequential sampler; here they are fixed once per split, so the estimate does not depend on how a
step is split into micro-batches and processes, and the rows can be shuffled as every other recipe's are.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch

from ..data.cache import fingerprint
from ..data.collate import PadCollator
from ..data.formats import as_messages
from ..data.pipeline import Pipeline, PreparedData, Tokenised
from ..data.sources import DataSource, fingerprint_sources, load_source
from ..data.tokenize import IGNORE_INDEX, cut_overlong, longest_token_chars
from ..errors import DataError
from ..models.tokenizer import setup_chat_template
from .data import (
    _response,
    encode_texts,
    held_out_pairs,
    preference_pair,
    prompt_and_response_texts,
    tokenise_cached,
    write_synthetic_preferences,
)

__all__ = [
    "KTOCollator",
    "KTOData",
    "KTOPipeline",
    "kl_batch",
    "mismatched_partners",
    "prepare_kto_data",
    "tokenize_unpaired",
    "unpaired_rows",
    "weights_advice",
    "with_kl_rows",
]

UNPAIRED_COLUMNS = ("prompt", "completion", "label")
PAIRED_COLUMNS = ("chosen", "rejected")  # and an optional prompt
# How far back `mismatched_partners` looks for a row of another prompt before it takes the neighbour anyway.
_SEARCH = 64


@dataclass(kw_only=True)
class KTOData(PreparedData):
    """The prepared data of a KTO run: tokenised rows with their KL rows."""

    keys: dict[str, str]  # cache keys of the splits (reference log-probabilities are cached under them)


def prepare_kto_data(config, cache_dir: Path, log: logging.Logger) -> KTOData:
    """Sources -> tokenizer -> tokenised train and eval rows with their KL rows, each from the cache when unchanged
    (`KTOConfig`)."""
    return KTOPipeline(config, cache_dir, log).prepare()


class KTOPipeline(Pipeline):
    """KTO's steps: rows rendered with the chat template and tokenised; a seeded held-out split; each split's
    mismatched KL rows, cached under the split's key."""

    def write_synthetic(self, directory, num_train, num_eval, seed):
        return write_synthetic_preferences(directory, num_train, num_eval, seed)  # pairs, split into rows

    def make_tokenizer(self):
        config = self.config
        texts = lambda: _texts(self.train_sources, self.cache_dir, config.seed)  # noqa: E731
        tokenizer = self.trained_tokenizer(fingerprint_sources(self.train_sources), texts, config.max_seq_length)
        return setup_chat_template(tokenizer, config.chat_template, config.trust_remote_code, self.log)

    def tokenise(self, sources: list[DataSource], name: str) -> Tokenised:
        return tokenise_cached(self, sources, name, "rows", "kto-rows", _build)

    def split(self, train: Tokenised) -> tuple[Tokenised, Tokenised]:
        return held_out_pairs(train, self.config.eval_split_ratio, self.config.seed)

    def finish(self, train: Tokenised, evaluation: Tokenised | None) -> KTOData:
        splits = {"train": self._with_kl_rows(train, "train")}
        if evaluation is not None:
            splits["eval"] = self._with_kl_rows(evaluation, "eval")
        labels = splits["train"].dataset["label"]
        advice = weights_advice(sum(labels), len(labels) - sum(labels), self.config.desirable_weight,
                                self.config.undesirable_weight)  # fmt: skip
        if advice:
            self.log.warning(advice)
        return KTOData(tokenizer=self.tokenizer, train=splits["train"].dataset,
                       eval=splits["eval"].dataset if evaluation else None,
                       keys={name: split.key for name, split in splits.items()},
                       stats={**train.stats, **self.notes})  # fmt: skip

    def _with_kl_rows(self, split: Tokenised, name: str) -> Tokenised:
        key = fingerprint({"rows": split.key, "kl": "rotated-other-prompt-1"})
        build = lambda scratch: (with_kl_rows(split.dataset, self.config.max_seq_length, scratch), {})  # noqa: E731
        dataset, _, _ = self.cached(key, build, f"{name} KL rows")
        return Tokenised(dataset, key, split.stats)


def weights_advice(desirable: int, undesirable: int, desirable_weight: float, undesirable_weight: float) -> str:
    """A warning when the rows are unbalanced and neither weight is in the range Eq. (8) of the KTO paper advises
    (desirable_weight x desirable / (undesirable_weight x undesirable) in [1, 4/3]), as TRL's; else ''."""
    desirable, undesirable = max(desirable, 1), max(undesirable, 1)
    if desirable == undesirable:
        return ""
    low, high = undesirable * undesirable_weight / desirable, undesirable * undesirable_weight / desirable * 1.33
    u_low, u_high = desirable * desirable_weight / undesirable / 1.33, desirable * desirable_weight / undesirable
    if low <= desirable_weight <= high or u_low <= undesirable_weight <= u_high:
        return ""
    return (
        f"{desirable} desirable and {undesirable} undesirable rows: the KTO paper advises desirable_weight in "
        f"[{low:.2f}, {high:.2f}] or undesirable_weight in [{u_low:.2f}, {u_high:.2f}] (one of them, not both)"
    )


def _sources_format(raw: datasets.Dataset, where: str) -> str:
    columns = raw.column_names
    if all(c in columns for c in ("completion", "label")):
        return "unpaired"
    if all(c in columns for c in PAIRED_COLUMNS):
        return "paired"
    raise DataError(f"{where}: KTO data needs columns prompt, completion and label (true/false), or preference "
                    f"pairs' chosen and rejected (and prompt); found {columns} (rename with {{path: ..., columns: "
                    "{old: new}})")  # fmt: skip


def unpaired_rows(row: dict[str, Any], where: str, paired: bool) -> list[tuple[list, list, bool, list | None]]:
    """(prompt, completion, label, tools) of each row one data row makes, as message lists: one for an unpaired row,
    two for a pair (the chosen response desirable, then the rejected one undesirable)."""
    if paired:
        prompt, chosen, rejected, tools = preference_pair(row, where)
        return [(prompt, chosen, True, tools), (prompt, rejected, False, tools)]
    label = row.get("label")
    if not isinstance(label, bool):  # 1/0, "yes", null: not guessed at
        raise DataError(f"{where}: column 'label' must be true (desirable) or false (undesirable), got {label!r:.100}")
    if row.get("prompt") is None:
        raise DataError(f"{where}: no 'prompt' (the row has no 'prompt' column, or it is null)")
    if row.get("completion") is None:
        raise DataError(f"{where}: no 'completion' (the row has no 'completion' column, or it is null)")
    prompt = as_messages(row["prompt"], "user", where, "prompt")
    completion = _response(row["completion"], prompt, "completion", where)
    if completion[0]["role"] != "assistant":
        raise DataError(f"{where}: the completion starts with a {completion[0]['role']} turn, not the assistant's")
    tools = row.get("tools")
    return [(prompt, completion, label, tools)]


def _texts(sources: list[DataSource], cache_dir: Path, seed: int):
    """Every prompt and completion as text, to train a tokenizer on."""
    for source in sources:
        raw = load_source(source, cache_dir, seed)
        paired = _sources_format(raw, source.where) == "paired"
        for number, row in enumerate(raw, 1):
            for prompt, completion, _, _ in unpaired_rows(row, f"{source.where}, row {number}", paired):
                yield "\n".join(m["content"] for m in prompt + completion)


def _build(sources: list[DataSource], tokenizer, config, cache_dir: Path, scratch: Path):
    parts = []
    for source in sources:
        raw = load_source(source, cache_dir, config.seed)
        paired = _sources_format(raw, source.where) == "paired"
        parts.append(
            raw.map(
                tokenize_unpaired, batched=True, with_indices=True, remove_columns=raw.column_names,
                fn_kwargs={"tokenizer": tokenizer, "max_seq_length": config.max_seq_length,
                           "overlong": config.overlong_examples, "where": source.where, "paired": paired,
                           "token_chars": longest_token_chars(tokenizer)},
                cache_file_name=str(scratch / f"rows-{len(parts)}.arrow"), desc=f"Tokenising {Path(source.path).name}",
            )
        )  # fmt: skip
    dataset = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    read, truncated = len(dataset), sum(dataset["truncated"])
    dataset = dataset.filter(lambda keep: keep, input_columns="keep", cache_file_name=str(scratch / "kept.arrow"))
    if len(dataset) == 0:
        raise DataError(f"no KTO row of {', '.join(s.path for s in sources)} fits max_seq_length")
    desirable = sum(dataset["label"])
    stats = {"rows_read": read, "truncated": truncated, "dropped": read - len(dataset), "rows_kept": len(dataset),
             "desirable": desirable, "undesirable": len(dataset) - desirable}  # fmt: skip
    return dataset.remove_columns(["keep", "truncated"]), stats


def tokenize_unpaired(batch: dict[str, list], indices: list[int], *, tokenizer, max_seq_length: int, overlong: str,
                      where: str, paired: bool, token_chars: int | None = None) -> dict[str, list]:  # fmt: skip
    """Batched `datasets.map` function: data rows -> KTO rows (`input_ids`, `labels`, `label`, `prompt_length`,
    `prompt_key`, `keep`, `truncated`); a pair makes two. The prompt and the completion are tokenised separately,
    as for pairs (`tunebook.preference.data.tokenize_pairs`)."""
    out: dict[str, list] = {k: [] for k in ("input_ids", "labels", "label", "prompt_length", "prompt_key", "keep",
                                            "truncated")}  # fmt: skip
    columns, texts, labels = list(batch), [], []
    for i, row in enumerate(indices):
        where_row = f"{where}, row {row + 1}"
        for prompt, completion, label, tools in unpaired_rows({c: batch[c][i] for c in columns}, where_row, paired):
            prompt_text, (rest,) = prompt_and_response_texts(tokenizer, prompt, (completion,), tools, where_row)
            texts += [prompt_text, rest]
            labels.append(label)
    ids = encode_texts(tokenizer, cut_overlong(tokenizer, texts, max_seq_length, token_chars))
    for prompt_ids, completion_ids, label in zip(ids[::2], ids[1::2], labels):
        room = max_seq_length - len(prompt_ids)
        keep, cut = room > 0, len(completion_ids) > room
        if cut:
            keep = keep and overlong == "truncate"
            completion_ids = completion_ids[: max(room, 0)]
        out["input_ids"].append(prompt_ids + completion_ids)
        out["labels"].append([IGNORE_INDEX] * len(prompt_ids) + completion_ids)
        out["label"].append(label)
        out["prompt_length"].append(len(prompt_ids))
        out["prompt_key"].append(_prompt_key(prompt_ids))
        out["keep"].append(keep)
        out["truncated"].append(cut and keep)
    return out


def _prompt_key(prompt_ids: list[int]) -> int:
    """A 63-bit hash of a prompt's tokens: rows of the same prompt get the same key (a rare collision only makes
    `mismatched_partners` look one row further)."""
    digest = hashlib.blake2b(str(prompt_ids).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def mismatched_partners(prompt_keys: list[int]) -> list[int]:
    """For each row, the row whose completion makes its KL row: the row before it (the first takes the last), as
    TRL rotates completions by one, or, when that row has the same prompt (a pair's two rows), the nearest earlier
    row of another prompt, so the KL row is truly mismatched. Deterministic: the pairing is part of the data."""
    n, partners = len(prompt_keys), []
    for i, key in enumerate(prompt_keys):
        j = (i - 1) % n
        for step in range(2, min(_SEARCH, n) + 1):
            if prompt_keys[j] != key:
                break
            j = (i - step) % n
        partners.append(j if prompt_keys[j] != key else (i - 1) % n)  # a single prompt: the neighbour anyway
    return partners


def with_kl_rows(dataset: datasets.Dataset, max_seq_length: int, scratch: Path) -> datasets.Dataset:
    """`dataset` with `kl_input_ids`/`kl_labels`: each row's prompt followed by its partner's completion
    (`mismatched_partners`), cut to max_seq_length (the prompt always fits: rows whose prompt fills it are
    dropped at tokenisation)."""
    partners = mismatched_partners(dataset["prompt_key"])
    others = dataset.select(partners).select_columns(["input_ids", "prompt_length"])
    others = others.flatten_indices(cache_file_name=str(scratch / "partners.arrow"))
    others = others.rename_columns({"input_ids": "other_input_ids", "prompt_length": "other_prompt_length"})
    joined = datasets.concatenate_datasets([dataset, others], axis=1)
    return joined.map(_kl_rows, batched=True, fn_kwargs={"max_seq_length": max_seq_length},
                      remove_columns=["other_input_ids", "other_prompt_length"],
                      cache_file_name=str(scratch / "kl.arrow"), desc="KL rows")  # fmt: skip


def _kl_rows(batch: dict[str, list], *, max_seq_length: int) -> dict[str, list]:
    kl_input_ids, kl_labels = [], []
    for ids, length, other, other_length in zip(batch["input_ids"], batch["prompt_length"], batch["other_input_ids"],
                                                batch["other_prompt_length"]):  # fmt: skip
        completion = other[other_length:][: max_seq_length - length]
        kl_input_ids.append(ids[:length] + completion)
        kl_labels.append([IGNORE_INDEX] * length + completion)
    return {"kl_input_ids": kl_input_ids, "kl_labels": kl_labels}


class KTOCollator:
    """A batch of B rows: the rows padded (`input_ids`, `attention_mask`, `labels` and the loss positions, as
    `PadCollator` makes them), their KL rows padded alike under `kl_`-prefixed keys, `label` (desirable: true), and
    precomputed reference log-probabilities (`ref_logps`, `ref_kl_logps`) when the data has them."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad = PadCollator(pad_token_id, pad_to_multiple_of)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.pad([{"input_ids": f["input_ids"], "labels": f["labels"]} for f in features])
        kl = self.pad([{"input_ids": f["kl_input_ids"], "labels": f["kl_labels"]} for f in features])
        batch.update({f"kl_{k}": v for k, v in kl.items()})
        batch["label"] = torch.tensor([f["label"] for f in features], dtype=torch.bool)
        for key in ("ref_logps", "ref_kl_logps"):
            if key in features[0]:
                batch[key] = torch.tensor([f[key] for f in features], dtype=torch.float32)
        return batch


def kl_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The KL rows of a `KTOCollator` batch, as a batch of their own (the keys `sequence_log_probs` reads)."""
    return {k[3:]: v for k, v in batch.items() if k.startswith("kl_")}
