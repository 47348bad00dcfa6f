"""Preference pairs with images, for DPO of a vision-language model: TRL's vision DPO format read, checked, tokenised
with the processor and cached as the image-text SFT path does (`tunebook.data.vision_sft`).

A row: an `images` column (`image` for one; paths relative to the data file, or any reference
`tunebook.data.images` reads) and `prompt`/`chosen`/`rejected` as the text path takes them (`preference_pair`):
a prompt of messages whose user content holds `{"type": "image"}` parts, or a string (the images then go before its
text, TRL's rule), with responses as strings or messages; or, with no prompt, chosen and rejected whole conversations
whose shared first turns, images included, are the prompt. Images belong to the prompt, which both responses share:
an image part in a response is refused. Inline image parts (`{"type": "image", "image": PATH}`) work as in SFT.

Each pair becomes `chosen_input_ids/labels` and `rejected_input_ids/labels` (the prompt's tokens, image tokens
included, identical in both and without labels; then the response's tokens, which alone carry them), the image
references and their sizes (from the headers: the tokens were counted with blank images of those sizes), and
`where`. The collator (`tunebook.data.vision_collate.VisionPairCollator`) opens a pair's images once, in the
DataLoader's workers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from ..data.cache import fingerprint
from ..data.image_files import image_reference
from ..data.images import (
    IMAGE_COLUMNS,
    _has_image_part,
    _image_values,
    _images_first,
    _listed,
    check_images,
    read_image_source,
)
from ..data.pipeline import Pipeline, Tokenised
from ..data.sources import DataSource, fingerprint_sources
from ..data.synthetic import write_synthetic_image_preferences
from ..data.tokenize import IGNORE_INDEX
from ..data.vision_sft import VISION_FEATURES, uses_images, vision_processor
from ..data.vision_tokenize import (
    images_fingerprint,
    processor_fingerprint,
    tokenise_cached,
    tokenize_image_prompt_and_responses,
)
from ..errors import DataError
from .data import PAIR_COLUMNS, PreferenceData, PreferencePipeline, held_out_pairs, preference_pair

__all__ = [
    "PAIR_IMAGE_FEATURES",
    "parse_image_pair",
    "prepare_preference_or_vision_data",
    "prepare_vision_preference_data",
    "tokenize_image_pairs",
]

VISION_PAIRS_VERSION = "1"  # bump when tokenising pairs with images changes what it produces
_IDS, _LABELS = datasets.List(datasets.Value("int32")), datasets.List(datasets.Value("int64"))
PAIR_IMAGE_FEATURES = datasets.Features({
    "chosen_input_ids": _IDS, "chosen_labels": _LABELS, "rejected_input_ids": _IDS, "rejected_labels": _LABELS,
    "keep": datasets.Value("bool"), "truncated": datasets.Value("bool"), "where": datasets.Value("string"),
    "images": VISION_FEATURES["images"], "image_sizes": VISION_FEATURES["image_sizes"],
})  # fmt: skip


def prepare_preference_or_vision_data(config, cache_dir: Path, log: logging.Logger) -> PreferenceData:
    """What `recipes/dpo.py` and `tunebook prepare --recipe dpo` prepare: pairs with images for a vision-language
    model (`uses_images`; `data.processor` set), else the text path's pairs."""
    if uses_images(config):
        return prepare_vision_preference_data(config, cache_dir, log)
    return PreferencePipeline(config, cache_dir, log).prepare()


def prepare_vision_preference_data(config, cache_dir: Path, log: logging.Logger) -> PreferenceData:
    """Sources -> processor -> checked images -> tokenised train and eval pairs (cached)."""
    return VisionPreferencePipeline(config, cache_dir, log).prepare()


def parse_image_pair(row: dict[str, Any], *, where: str, base_dir: str | Path | None = None,
                     data_format: str = "pairs") -> dict[str, Any]:  # fmt: skip
    """One row -> `{"prompt", "chosen", "rejected"}` message lists (image parts bare placeholders, in the prompt
    only), `images` (references in placeholder order) and `tools` where given. `data_format` is unused (the
    signature of `parse_image_row`, which `read_image_source` calls in its place)."""
    missing = [c for c in PAIR_COLUMNS if c not in row]
    if missing:
        raise DataError(f"{where}: preference data needs columns chosen and rejected (and prompt, or conversations "
                        f"that share their first turns); missing {missing} (found {sorted(row)})")  # fmt: skip
    columns = [c for c in IMAGE_COLUMNS if c in row]
    if len(columns) > 1:
        raise DataError(f"{where}: both an 'images' and an 'image' column; keep one")
    column = columns[0] if columns else None
    listed = _listed(row.get(column) if column else None)
    row = dict(row)
    if row.get("prompt") is not None:  # TRL's rule: images without placeholders go first in the first user turn
        prompt = row["prompt"]
        row["prompt"] = _images_first([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
                                      len(listed))  # fmt: skip
    else:  # the shared first turns are the prompt: placed alike in both, they stay shared
        row["chosen"], row["rejected"] = (_images_first(row[side], len(listed)) for side in ("chosen", "rejected"))
    prompt, chosen, rejected, tools = preference_pair(row, where, image_parts=True)
    if _has_image_part(chosen) or _has_image_part(rejected):
        raise DataError(f"{where}: an image in the chosen or rejected response; a pair's images belong to the prompt, "
                        "which both responses share")  # fmt: skip
    values = _image_values(prompt, listed, column, "chat", where)
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    images = [image_reference(v, base, f"{where}, image {k}") for k, v in enumerate(values, 1)]
    out = {"prompt": prompt, "chosen": chosen, "rejected": rejected, "images": images}
    return {**out, "tools": tools} if tools else out


def tokenize_image_pairs(batch: dict[str, list], *, processor, max_seq_length: int,
                         overlong: str) -> dict[str, list]:  # fmt: skip
    """Batched `datasets.map` function over checked rows (`conversation`, `image_sizes`): the prompt's ids (kept
    whole, labels IGNORE_INDEX) then each response's (cut to fit with `overlong: truncate`); `keep` is false for a
    pair whose prompt leaves no room for a response, or that is too long with `overlong: drop`."""
    out: dict[str, list] = {k: [] for k in ("chosen_input_ids", "chosen_labels", "rejected_input_ids",
                                            "rejected_labels", "keep", "truncated", "where")}  # fmt: skip
    for row, sizes in zip(batch["conversation"], batch["image_sizes"]):
        pair = json.loads(row)
        where = pair["where"]
        responses = [pair["chosen"], pair["rejected"]]
        try:
            prompt_ids, rests = tokenize_image_prompt_and_responses(
                processor, pair["prompt"], responses, sizes, pair.get("tools")
            )
        except DataError as error:
            raise DataError(f"{where}: {error}") from None
        keep, cut = len(prompt_ids) < max_seq_length, False  # the prompt (and its images) is never cut
        for side, response_ids in zip(("chosen", "rejected"), rests):
            room = max_seq_length - len(prompt_ids)
            if len(response_ids) > room:
                cut, keep = True, keep and overlong == "truncate"
                response_ids = response_ids[: max(room, 0)]
            out[f"{side}_input_ids"].append(prompt_ids + response_ids)
            out[f"{side}_labels"].append([IGNORE_INDEX] * len(prompt_ids) + response_ids)
        out["keep"].append(keep)
        out["truncated"].append(cut and keep)
        out["where"].append(where)
    return out


class VisionPreferencePipeline(Pipeline):
    """Preference pairs' steps for a vision-language model: its processor, the images checked, the pairs tokenised
    with blank images of their sizes and cached, a seeded held-out split (as the text pairs')."""

    write_synthetic = staticmethod(write_synthetic_image_preferences)

    def make_tokenizer(self):
        # A pair's text holds its prompt once and both responses: up to twice max_seq_length tokens.
        texts = lambda: _texts(self._read(self.train_sources))  # noqa: E731
        self.processor = vision_processor(self, texts, 2 * self.config.max_seq_length)
        return self.processor.tokenizer

    def _read(self, sources: list[DataSource]) -> datasets.Dataset:
        config = self.config
        parts = [read_image_source(s, self.cache_dir, config.seed, image_dir=config.image_dir, data_format="pairs",
                                   num_proc=config.dataset_num_proc, parse=parse_image_pair)
                 for s in sources]  # fmt: skip
        return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]

    def tokenise(self, sources: list[DataSource], name: str) -> Tokenised:
        config, log = self.config, self.log
        checked = check_images(self._read(sources), on_bad_image=config.on_bad_image,
                               max_pixels=config.max_image_pixels, num_proc=config.dataset_num_proc)  # fmt: skip
        if checked.skipped:
            log.warning("%s pairs: %d skipped for a bad image (on_bad_image: skip), the first: %s", name,
                        checked.skipped, checked.first_skipped[0])  # fmt: skip
        key = fingerprint({
            "pairs": fingerprint_sources(sources), "processor": processor_fingerprint(self.processor),
            "images": images_fingerprint(checked.dataset), "image_dir": config.image_dir,
            "max_seq_length": config.max_seq_length, "overlong": config.overlong_examples,
            "version": f"image-pairs-{VISION_PAIRS_VERSION}",
        })  # fmt: skip

        def build(scratch: Path):
            return _tokenised(checked.dataset, self.processor, config, key, scratch)

        dataset, stats, cached = self.cached(key, build, f"{name} tokenisation")
        stats = {**stats, "skipped_bad_image": checked.skipped}
        log.info("%s pairs with images: %d (%s); %s", name, len(dataset), "cached" if cached else "tokenised", stats)
        if stats["truncated"] or stats["dropped"]:
            log.warning("%s pairs: %d truncated and %d dropped at max_seq_length=%d", name,
                        stats["truncated"], stats["dropped"], config.max_seq_length)  # fmt: skip
        return Tokenised(dataset, key, stats)

    def split(self, train: Tokenised) -> tuple[Tokenised, Tokenised]:
        return held_out_pairs(train, self.config.eval_split_ratio, self.config.seed)

    def finish(self, train: Tokenised, evaluation: Tokenised | None) -> PreferenceData:
        keys = {"train": train.key, **({"eval": evaluation.key} if evaluation else {})}
        return PreferenceData(tokenizer=self.tokenizer, processor=self.processor, train=train.dataset,
                              eval=evaluation and evaluation.dataset, keys=keys,
                              stats={**train.stats, **self.notes})  # fmt: skip


def _texts(pairs: datasets.Dataset):
    """Every message's text parts, to train a tokenizer on."""
    for row in pairs["conversation"]:
        pair = json.loads(row)
        for m in pair["prompt"] + pair["chosen"] + pair["rejected"]:
            content = m.get("content")
            parts = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
            yield "".join(p.get("text", "") for p in parts if p.get("type") == "text")


def _tokenised(checked: datasets.Dataset, processor, config, key: str, scratch: Path):
    tokenised = tokenise_cached(checked, tokenize_image_pairs, processor, PAIR_IMAGE_FEATURES, config, key, scratch,
                                "Tokenising pairs (images as blanks of their sizes)")  # fmt: skip
    keep = np.asarray(tokenised.data.column("keep"), dtype=bool)
    stats = {
        "pairs_read": len(tokenised),
        "truncated": int(np.asarray(tokenised.data.column("truncated"), dtype=bool).sum()),
        "dropped": int((~keep).sum()),
        "pairs_kept": int(keep.sum()),
        "images": int(sum(len(s) for s in tokenised.data.column("image_sizes").to_pylist())),
    }
    if not stats["pairs_kept"]:
        raise DataError(f"no preference pair with images fits max_seq_length={config.max_seq_length} "
                        f"({stats['pairs_read']} read): the prompt, its image tokens included, must leave room for "
                        "the responses")  # fmt: skip
    kept = tokenised.select(np.flatnonzero(keep)).remove_columns(["keep", "truncated"])
    return kept.flatten_indices(cache_file_name=str(scratch / "kept.arrow")), stats
