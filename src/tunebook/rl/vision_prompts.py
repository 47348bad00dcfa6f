"""Prompts with images, for GRPO of a vision-language model: the prompt path of `tunebook.rl.prompts` with the
image-text pieces of SFT (`tunebook.data.images`, `vision_tokenize`, `vision_collate`).

A row is TRL's prompt-only format with images: `prompt` (text, or messages whose content parts include
`{"type": "image"}` placeholders, or inline `{"type": "image", "image": PATH}` parts) and an `images` column (or
`image`) that fills the placeholders in order; a text prompt's images go before its text, as TRL does. Every other
column reaches the reward functions, as in the text path, and so do the images: `images`, each completion's list of
resolved image paths (None for an image the data holds as bytes, not as a file).

Preparation reads every image's header for its size (a missing or unreadable image is one line naming the file, row
and image, or with `on_bad_image: skip` a dropped row, counted), renders the prompt with the processor's chat template
and its generation prompt, and tokenises it with blank images of those sizes: `prompt_ids` hold the image tokens the
processor expands. Cached as the SFT path caches, keyed by the processor and the image references with their sizes.
The loader's workers decode the images (`VisionPromptRows`), once per prompt for its whole group of completions.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch

from ..data.cache import fingerprint
from ..data.collate import PadCollator
from ..data.image_files import DEFAULT_MAX_IMAGE_PIXELS
from ..data.images import IMAGE_COLUMNS, check_images, image_base_dir, parse_image_prompt
from ..data.pipeline import Tokenised
from ..data.sources import DataSource, fingerprint_sources
from ..data.synthetic import write_synthetic_image_task
from ..data.tokenize import IGNORE_INDEX
from ..data.vision_collate import VisionCollator, decoded_image_inputs
from ..data.vision_sft import uses_images, vision_processor
from ..data.vision_tokenize import (
    image_token_ids,
    images_fingerprint,
    processor_fingerprint,
    tokenize_image_conversation,
    tokenize_image_prompt,
)
from ..errors import DataError
from ..training.warmup import sft_warmup
from .prompts import (
    PromptData,
    PromptPipeline,
    PromptRows,
    load_prompts,
    prepare_text_prompt_data,
    reference_examples,
)

__all__ = [
    "PromptImages",
    "VisionPromptPipeline",
    "VisionPromptRows",
    "prepare_prompt_data",
    "prompt_images",
    "vision_reference_examples",
    "write_synthetic_image_prompts",
    "warm_up",
    "warmup_examples",
]

VISION_PROMPTS_VERSION = "1"  # bump when what the preparation produces changes
# Columns this path adds beside `PROMPT_COLUMNS`: the prompt in the normal form of `tunebook.data.images` (JSON with
# `where`), the image references (plain structs: see `vision_sft.VISION_FEATURES`), their sizes, the row's name.
OWN_COLUMNS = ("conversation", "images", "image_sizes", "where")
_REFERENCES = datasets.List({"bytes": datasets.Value("binary"), "path": datasets.Value("string")})


def prepare_prompt_data(config, cache_dir: Path, log) -> PromptData:
    """What recipes/grpo.py and `tunebook prepare --recipe grpo` prepare: a vision-language model's prompts with their
    images (`data.processor` set), else text prompts (`prepare_text_prompt_data`)."""
    if uses_images(config):
        return VisionPromptPipeline(config, cache_dir, log).prepare()
    return prepare_text_prompt_data(config, cache_dir, log)


class VisionPromptPipeline(PromptPipeline):
    """The prompt pipeline's steps for a vision-language model: its processor, the images checked, the prompts
    tokenised with blank images of their sizes; the held-out split and the row numbers as for text."""

    def write_synthetic(self, directory, num_train, num_eval, seed):
        return write_synthetic_image_prompts(directory, num_train, num_eval, seed)

    def make_tokenizer(self):
        self.processor = vision_processor(self, lambda: _texts(self._read(self.train_sources)))
        return self.processor.tokenizer

    def _read(self, sources: list[DataSource]) -> datasets.Dataset:
        parts = [_read_source(s, self.cache_dir, self.config) for s in sources]
        return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]

    def tokenise(self, sources: list[DataSource], name: str):
        config, log = self.config, self.log
        checked = check_images(self._read(sources), on_bad_image=config.on_bad_image,
                               max_pixels=config.max_image_pixels, num_proc=config.dataset_num_proc)  # fmt: skip
        if checked.skipped:
            log.warning("%s prompts: %d skipped for a bad image (on_bad_image: skip), the first: %s", name,
                        checked.skipped, checked.first_skipped[0])  # fmt: skip
        key = fingerprint({
            "prompts": fingerprint_sources(sources), "processor": processor_fingerprint(self.processor),
            "images": images_fingerprint(checked.dataset), "image_dir": config.image_dir,
            "max_prompt_length": config.max_prompt_length, "version": VISION_PROMPTS_VERSION,
        })  # fmt: skip
        build = lambda scratch: _build(checked.dataset, self.processor, config, key, scratch)  # noqa: E731
        dataset, stats, cached = self.cached(key, build, f"{name} tokenisation")
        stats = {**stats, "skipped_bad_image": checked.skipped}
        log.info("%s prompts with images: %d (%s); %s", name, len(dataset), "cached" if cached else "tokenised", stats)
        if stats["dropped"]:
            log.warning("%s prompts: %d longer than max_prompt_length=%d (image tokens included) dropped", name,
                        stats["dropped"], config.max_prompt_length)  # fmt: skip
        return Tokenised(dataset, key, stats)

    def finish(self, train, evaluation) -> PromptData:
        data = super().finish(train, evaluation)
        data.processor = self.processor  # saved with the model in the tokenizer's place
        return data


def _read_source(source: DataSource, cache_dir: Path, config) -> datasets.Dataset:
    """A source's prompts in the normal form (`conversation`, `images`, `where`), its other columns kept."""
    raw = load_prompts(source, cache_dir, config.seed)
    clash = [c for c in ("conversation", "image_sizes", "where") if c in raw.column_names]
    if clash:
        raise DataError(f"{source.where}: column(s) {clash} are Tunebook's own with images; rename them")
    column = next((c for c in IMAGE_COLUMNS if c in raw.column_names), None)
    features = datasets.Features({k: v for k, v in raw.features.items() if k not in IMAGE_COLUMNS})
    features.update(
        {"conversation": datasets.Value("string"), "images": _REFERENCES, "where": datasets.Value("string")}
    )
    return raw.map(
        _normal_form, batched=True, with_indices=True, features=features,
        remove_columns=[c for c in IMAGE_COLUMNS if c in raw.column_names],
        fn_kwargs={"column": column, "where": source.where, "base_dir": image_base_dir(source, config.image_dir)},
        num_proc=config.dataset_num_proc, desc=f"Reading {Path(source.path).name} (prompts with images)",
    )  # fmt: skip


def _normal_form(batch: dict[str, list], indices: list[int], *, column, where: str, base_dir) -> dict[str, list]:
    out: dict[str, list] = {"conversation": [], "images": [], "where": []}
    for i, prompt in enumerate(batch["prompt"]):
        where_row = f"{where}, row {indices[i] + 1}"
        images = batch[column][i] if column else None
        messages, references = parse_image_prompt(prompt, images, where=where_row, column=column, base_dir=base_dir)
        if messages[-1]["role"] == "assistant":
            raise DataError(f"{where_row}: the prompt ends with an assistant turn; GRPO generates that turn (put the "
                            "answer in another column, e.g. 'answer')")  # fmt: skip
        out["conversation"].append(json.dumps({"messages": messages, "where": where_row}))
        out["images"].append(references)
        out["where"].append(where_row)
    return out


def _texts(prompts: datasets.Dataset):
    """The prompts' text parts and the reference answers' columns, to train a tokenizer on."""
    for row in prompts:
        messages = json.loads(row["conversation"])["messages"]
        parts = [p for m in messages if isinstance(m.get("content"), list) for p in m["content"]]
        texts = [p["text"] for p in parts if p.get("type") == "text"]
        yield "\n".join(texts + [str(v) for k, v in row.items() if k not in (*OWN_COLUMNS, "prompt") and v])


def _build(checked: datasets.Dataset, processor, config, key: str, scratch: Path):
    def tokenise(batch):
        ids = []
        for row, sizes in zip(batch["conversation"], batch["image_sizes"]):
            example = json.loads(row)
            try:
                ids.append(tokenize_image_prompt(processor, example["messages"], sizes))
            except DataError as error:
                raise DataError(f"{example['where']}: {error}") from None
        return {"prompt_ids": ids, "keep": [len(i) <= config.max_prompt_length for i in ids]}

    tokenised = checked.map(tokenise, batched=True, batch_size=100, new_fingerprint=key,
                            cache_file_name=str(scratch / "prompts.arrow"), desc="Tokenising prompts (images as blanks)")  # fmt: skip
    read = len(tokenised)
    kept = tokenised.filter(lambda keep: keep, input_columns="keep", cache_file_name=str(scratch / "kept.arrow"))
    if len(kept) == 0:
        raise DataError(f"no prompt fits max_prompt_length ({config.max_prompt_length} tokens, image tokens included)")
    kept = kept.remove_columns("keep").add_column("row", list(range(len(kept))))
    images = sum(len(s) for s in kept.data.column("image_sizes").to_pylist())
    return kept, {"prompts_read": read, "dropped": read - len(kept), "prompts_kept": len(kept), "images": images}


class VisionPromptRows:
    """`PromptRows`' batch with each prompt's images decoded here, in the loader's workers: `image_inputs`, the
    image processor's outputs for every prompt's images `repeat` times over (its `num_generations` completions share
    them; each image decoded once), and `images`, each prompt's resolved image paths for the reward functions."""

    def __init__(self, processor, repeat: int = 1, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
        self.processor, self.repeat, self.max_image_pixels = processor, repeat, max_image_pixels
        self.pad = PadCollator(processor.tokenizer.pad_token_id)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        # The prompts padded only to check each one's image tokens against its images as decoded now.
        ids = self.pad([{"input_ids": f["prompt_ids"], "labels": f["prompt_ids"]} for f in features])["input_ids"]
        inputs = decoded_image_inputs(self.processor, features, ids, self.max_image_pixels, repeat=self.repeat)
        inputs.pop("mm_token_type_ids", None)  # of these padded prompts: `PromptImages` makes each batch's own
        batch = PromptRows()([{k: v for k, v in f.items() if k not in OWN_COLUMNS} for f in features])
        batch["images"] = [[r["path"] if r["bytes"] is None else None for r in f["images"]] for f in features]
        batch["image_inputs"] = inputs
        return batch


@dataclass
class PromptImages:
    """The images of a batch of rows (prompts, or prompts with their completions), for `model.generate` and the
    log-probs: the image processor's outputs for the rows' images in row order, and the processor, which says what
    else its model reads of a row's tokens (Qwen-VL's `mm_token_type_ids`, for its 3-D rotary positions)."""

    pixels: dict[str, torch.Tensor]
    processor: Any

    def inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's image keyword arguments for rows `input_ids` (padded either side), on their device."""
        out = {k: v.to(input_ids.device) for k, v in self.pixels.items()}
        if "mm_token_type_ids" in self.processor.model_input_names:
            types = self.processor.create_mm_token_type_ids(input_ids.tolist())
            out["mm_token_type_ids"] = torch.tensor(types, dtype=torch.long, device=input_ids.device)
        return out

    def suppressed_tokens(self) -> list[int]:
        """Tokens a completion must never hold: those that stand for images (or videos). A sampled one would need
        an image's features the batch does not have, and the model would refuse the rows (or misplace every image)."""
        videos = getattr(self.processor, "video_token_ids", None) or []
        return sorted(image_token_ids(self.processor) | {i for i in videos if i is not None})


def prompt_images(batch: dict[str, Any], processor) -> PromptImages | None:
    """A `VisionPromptRows` batch's `PromptImages`; None for a text model's batch (no processor)."""
    return None if processor is None else PromptImages(batch["image_inputs"], processor)


def warmup_examples(data: PromptData, reference_column: str, max_seq_length: int, max_image_pixels: int,
                    tools: list[dict] | None = None):  # fmt: skip
    """(examples, collate_fn) of GRPO's SFT warm-up: the prompts with their reference answers (or completions, with
    the `tools` definitions: `reference_examples`), and for a vision-language model (`data.processor`) with their
    images and the collator that decodes them (None: the warm-up's own padding)."""
    if data.processor is None:
        return reference_examples(data.train, data.tokenizer, reference_column, max_seq_length, tools), None
    examples = vision_reference_examples(data.train, data.processor, reference_column, max_seq_length)
    return examples, VisionCollator(data.processor, max_image_pixels=max_image_pixels)


def warm_up(config, model, data: PromptData, device, log, tools: list[dict] | None = None) -> None:
    """GRPO's SFT warm-up (`sft_warmup_steps`): a brief SFT on the reference answers (or completions, tool calls
    included, with the `tools` definitions), which teaches the answer format before GRPO rewards it."""
    examples, collate = warmup_examples(data, config.reference_column, config.max_seq_length,
                                        config.max_image_pixels, tools)  # fmt: skip
    sft_warmup(
        model,
        examples,
        data.tokenizer.pad_token_id,
        steps=config.sft_warmup_steps,
        seed=config.seed,
        batch_size=32,
        device=device,
        log=log,
        max_grad_norm=1.0,
        collate_fn=collate,
        learning_rate=config.sft_warmup_learning_rate,
    )  # fmt: skip  (constant: GRPO goes on unannealed)


def vision_reference_examples(prompts: datasets.Dataset, processor, reference_column: str, max_seq_length: int):
    """SFT examples (input_ids, labels on the answer, images, where) of the prompts with their reference answers,
    for the SFT warm-up of a vision-language model (`tunebook.data.VisionCollator` batches them)."""
    if reference_column not in prompts.column_names:
        raise DataError(f"an SFT warm-up needs the reference answers (column {reference_column!r}; found "
                        f"{prompts.column_names}); set reference_column, or sft_warmup_steps 0")  # fmt: skip

    def tokenise(batch):
        out = {"input_ids": [], "labels": []}
        for row, sizes, answer in zip(batch["conversation"], batch["image_sizes"], batch[reference_column]):
            prompt = json.loads(row)["messages"]
            answer = {"role": "assistant", "content": [{"type": "text", "text": str(answer)}]}
            ids, labels, _ = tokenize_image_conversation(processor, prompt + [answer], sizes, first=len(prompt))
            out["input_ids"].append(ids)
            out["labels"].append(labels)
        return out

    examples = prompts.map(tokenise, batched=True, keep_in_memory=True, desc="Tokenising the warm-up's answers")
    examples = examples.filter(lambda ids, labels: len(ids) <= max_seq_length and any(x != IGNORE_INDEX for x in labels),
                               input_columns=["input_ids", "labels"], keep_in_memory=True)  # fmt: skip
    return examples.select_columns(["input_ids", "labels", "images", "where"])


def write_synthetic_image_prompts(directory: str | Path, num_train: int, num_eval: int, seed: int):
    """The shapes task (`tunebook.data.write_synthetic_image_task`) as prompts: `{"prompt": [a user turn with an
    image placeholder and "What colour is the square?"], "images": [...], "answer": "red"}`, written beside its
    files (`prompts-train.jsonl`, `prompts-eval.jsonl`, image paths relative to them); returns their paths."""
    paths = []
    for path in write_synthetic_image_task(directory, num_train, num_eval, seed):
        out = path.with_name(f"prompts-{path.name}")
        if not out.is_file():
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            text = "".join(json.dumps({"prompt": r["messages"][:1], "images": r["images"],
                                       "answer": r["messages"][1]["content"][0]["text"]}) + "\n" for r in rows)  # fmt: skip
            tmp = out.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(text)
            tmp.replace(out)
        paths.append(out)
    return tuple(paths)
