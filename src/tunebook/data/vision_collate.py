"""Collators for rows with images (`tunebook.data.vision_sft`): padded like `PadCollator` (training, evaluation
loss), packed like `PackedCollator`, or left-padded prompts like `PromptCollator` (generation), with the row's
images decoded here, in the DataLoader's workers, and run through the processor's image processor: `pixel_values`
and what else the family takes (`image_grid_thw` for Qwen-VL, ...), and `mm_token_type_ids` where the processor
makes them (Qwen-VL's multimodal rotary positions read them). Classes, not closures, so the workers can pickle them.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from .. import compat
from ..errors import ConfigError, DataError
from ..models.attention import PACKABLE_VISION_FAMILIES, packing_refusal
from .collate import PackedCollator, PadCollator, PairCollator, PromptCollator
from .image_files import DEFAULT_MAX_IMAGE_PIXELS, open_images

__all__ = [
    "VisionCollator",
    "VisionPackedCollator",
    "VisionPairCollator",
    "VisionPromptCollator",
    "decoded_image_inputs",
    "image_columns",
    "image_inputs_of",
]

_DTYPES = {"float32": torch.float32, "int64": torch.int64}  # of cache_pixel_values' entries (data/pixel_cache.py)
# What the collators read beside input_ids and labels (and seq_lengths), where the rows have them: packed rows'
# images_per_example, cache_pixel_values' pixel_inputs.
_IMAGE_COLUMNS = ("images", "where", "images_per_example", "pixel_inputs")


def image_columns(dataset) -> list[str]:
    """The image columns a vision collator reads from `dataset`'s rows (those of `_IMAGE_COLUMNS` it has)."""
    return [c for c in _IMAGE_COLUMNS if c in dataset.column_names]


class VisionCollator:
    """`PadCollator`'s batch (input_ids, attention_mask, labels, loss positions) and the images' inputs."""

    def __init__(self, processor, pad_to_multiple_of: int | None = None,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):  # fmt: skip
        self.processor, self.max_image_pixels = processor, max_image_pixels
        self.pad = PadCollator(processor.tokenizer.pad_token_id, pad_to_multiple_of)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.pad(features)
        batch.update(decoded_image_inputs(self.processor, features, batch["input_ids"], self.max_image_pixels))
        return batch


class VisionPairCollator:
    """`PairCollator`'s batch of B pairs (2B rows, the chosen first) and the images' inputs: each pair's images are
    opened once and given to both of its rows, so the model gets them for the chosen rows, then again for the
    rejected rows, in the order their placeholders appear in the batch."""

    def __init__(self, processor, pad_to_multiple_of: int | None = None,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):  # fmt: skip
        self.processor, self.max_image_pixels = processor, max_image_pixels
        self.pairs = PairCollator(processor.tokenizer.pad_token_id, pad_to_multiple_of)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.pairs(features)
        images = [open_images(f["images"], f["where"], self.max_image_pixels) for f in features]
        # The image processor runs on both halves' images (not its outputs copied): each family lays its
        # pixel_values out its own way (Qwen-VL: flattened patches of every image; LLaVA: one tensor an image).
        batch.update(image_inputs_of(self.processor, images + images, features + features, batch["input_ids"]))
        return batch


class VisionPackedCollator:
    """`PackedCollator`'s packed rows (positions and segment ids restarting per example) and the images' inputs, in
    the rows' order, so each image meets its own placeholders. For a family with 3-D rotary positions (Qwen-VL)
    also `rope_position_ids` (batch, 3, length): each example's positions as the model computes them for the
    example alone (its `get_rope_index` with the example's tokens and image grids), restarting at every example.

    Args:
        model_config: the model's config (its `model_type` picks the positions; Qwen-VL's carries the merge size).
    """

    def __init__(self, processor, model_config, pad_to_multiple_of: int | None = None,
                 attn_implementation: str | None = None, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):  # fmt: skip
        family = model_config.model_type
        if family not in PACKABLE_VISION_FAMILIES:
            raise ConfigError(packing_refusal(family))
        self.processor, self.max_image_pixels = processor, max_image_pixels
        self.pack = PackedCollator(processor.tokenizer.pad_token_id, pad_to_multiple_of, attn_implementation)
        self.model_config = model_config if PACKABLE_VISION_FAMILIES[family] == "3-D" else None
        self._rope = None  # the model's rope index, built on first use in each worker (`_rope_model`)

    def __getstate__(self):  # the workers get the config and build their own rope index
        return {**self.__dict__, "_rope": None}

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.pack(features)
        batch.update(decoded_image_inputs(self.processor, features, batch["input_ids"], self.max_image_pixels))
        if self.model_config is not None:
            self._rope = self._rope or _rope_model(self.model_config)
            batch["rope_position_ids"] = packed_rope_positions(self._rope, features, batch)
        return batch


def _rope_model(model_config):
    """The model's inner class (`Qwen2VLModel`, ...) on the meta device, for its `get_rope_index` alone: the method
    reads only the config, and the meta device holds no weights, so a loader's worker builds one in milliseconds."""
    from transformers import AutoModel

    config = copy.deepcopy(model_config)
    with torch.device("meta"):
        return AutoModel.from_config(config, attn_implementation="eager")


def packed_rope_positions(rope_model, features: list[dict[str, Any]], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(batch, 3, length) rotary positions of packed rows: every example's as `rope_model.get_rope_index` gives
    them for the example alone, with its own image grids (`image_grid_thw` holds the batch's images in row order,
    `images_per_example` how many each example has); the padding tail counts 0, 1, 2, ... as its text would."""
    input_ids, types = batch["input_ids"], batch["mm_token_type_ids"]
    grids = batch.get("image_grid_thw")
    positions = torch.arange(input_ids.shape[1]).repeat(input_ids.shape[0], 3, 1)
    image = 0
    for i, f in enumerate(features):
        start = 0
        for length, count in zip(f["seq_lengths"], f["images_per_example"]):
            span = slice(start, start + length)
            example_grids = grids[image : image + count] if count else None
            if count:
                rope, _ = rope_model.get_rope_index(input_ids[i : i + 1, span], types[i : i + 1, span],
                                                    image_grid_thw=example_grids)  # fmt: skip
                positions[i, :, span] = rope[:, 0]
            else:  # text alone: the model counts positions as a text model does
                positions[i, :, span] = torch.arange(length)
            image += count
            start += length
        positions[i, :, start:] = torch.arange(input_ids.shape[1] - start)
    return positions


class VisionPromptCollator:
    """`PromptCollator`'s left-padded prompts and reference answers, and the images of each prompt's inputs."""

    def __init__(self, processor, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
        self.processor, self.max_image_pixels = processor, max_image_pixels
        self.prompts = PromptCollator(processor.tokenizer.pad_token_id)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.prompts(features)
        batch.update(decoded_image_inputs(self.processor, features, batch["input_ids"], self.max_image_pixels))
        return batch


def decoded_image_inputs(
    processor,
    features: list[dict[str, Any]],
    input_ids: torch.Tensor,
    max_pixels: int,
    *,
    mm_types: bool = True,
    repeat: int = 1,
) -> dict:
    """The image processor's outputs for the rows' images, in row order, checked against the image tokens of each
    row of `input_ids` (or, with `cache_pixel_values`, the outputs cached and checked at preparation); and
    `mm_token_type_ids` where the processor's model takes them. With `repeat`, each row stands for `repeat`
    consecutive rows that share its images (GRPO's completions of one prompt): every image is decoded once, and the
    outputs (and `mm_token_type_ids`) are those of the repeated rows."""
    rows = [f for f in features for _ in range(repeat)]
    input_ids = input_ids.repeat_interleave(repeat, dim=0) if repeat > 1 else input_ids
    if "pixel_inputs" in features[0]:
        return _with_mm_types(processor, cached_image_inputs(rows), input_ids, mm_types)
    opened = [open_images(f["images"], f.get("where", f"row {i + 1}"), max_pixels) for i, f in enumerate(features)]
    images = [row for row in opened for _ in range(repeat)]
    return image_inputs_of(processor, images, rows, input_ids, mm_types)


def image_inputs_of(
    processor, images: list[list], features: list[dict[str, Any]], input_ids: torch.Tensor, mm_types: bool = True
) -> dict:
    """`decoded_image_inputs` of images already opened: `images[i]` are row i's (`features[i]` names it in errors)."""
    flat = [image for row in images for image in row]
    out: dict[str, Any] = {}
    if flat:
        out = dict(processor.image_processor(images=flat, return_tensors="pt"))
        _check_image_tokens(processor, input_ids, images, out, features)
    return _with_mm_types(processor, out, input_ids, mm_types)


def _with_mm_types(processor, out: dict, input_ids: torch.Tensor, mm_types: bool) -> dict:
    """`out` and the `mm_token_type_ids` of `input_ids` where the processor's model takes them (Qwen-VL)."""
    if mm_types and "mm_token_type_ids" in processor.model_input_names:
        types = processor.create_mm_token_type_ids(input_ids.tolist())
        out["mm_token_type_ids"] = torch.tensor(types, dtype=torch.long)
    return out


def _check_image_tokens(processor, input_ids, images: list[list], out: dict, features: list[dict]) -> None:
    """Each row holds as many image tokens as its images' pixel values need: the count was made at preparation
    from the sizes in the images' headers, and an image replaced since by one of another size would shift every
    token after it (the model refuses the batch, or worse, a family that does not check trains on it)."""
    flat = [image for row in images for image in row]
    if "image_grid_thw" in out:  # Qwen-VL: one token per merge_size x merge_size patches of the grid
        merge = processor.image_processor.merge_size
        needed = (out["image_grid_thw"].prod(-1) // (merge * merge)).tolist()
    else:
        needed = compat.image_token_counts(processor, [(image.height, image.width) for image in flat])
    ids = torch.tensor(sorted(i for i in processor.image_token_ids if i is not None))
    have = torch.isin(input_ids, ids).sum(-1).tolist()
    start = 0
    for i, row in enumerate(images):
        need = sum(needed[start : start + len(row)])
        start += len(row)
        if have[i] != need:
            sizes = ", ".join(f"{image.width}x{image.height}" for image in row)
            raise DataError(f"{features[i].get('where', f'row {i + 1}')}: {have[i]} image tokens in the row, but its "
                            f"images ({sizes}) need {need}: an image changed since the data was prepared (the "
                            "token counts come from the sizes read then); run again to prepare it anew")  # fmt: skip


def cached_image_inputs(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The rows' image processor outputs cached at preparation (`cache_pixel_values`, data/pixel_cache.py),
    concatenated along the first dimension in row order, as the image processor does for a batch of images."""
    parts: dict[str, list[torch.Tensor]] = {}
    for row in features:
        for entry in row["pixel_inputs"]:
            values = torch.from_numpy(np.asarray(entry["values"], dtype=np.float32))
            tensor = values.reshape(entry["shape"]).to(_DTYPES[entry["dtype"]])
            parts.setdefault(entry["name"], []).append(tensor)
    return {name: torch.cat(tensors) for name, tensors in parts.items()}
