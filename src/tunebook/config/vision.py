"""The config keys of a recipe that trains a vision-language model on images (sft): a second base class of its
config, fields only, as `CausalLMConfig` is."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError
from .fields import config_field

__all__ = ["DEFAULT_MAX_IMAGE_PIXELS", "VisionConfig", "check_image_dir", "check_vision_keys"]

# Pillow's decompression-bomb warning threshold (tunebook.data.image_files.DEFAULT_MAX_IMAGE_PIXELS, equal by test):
# written out here, since a config is checked before the data code loads.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485


@dataclass
class VisionConfig:
    """Keys read when the model is a vision-language model (`AutoModelForImageTextToText`); a text model ignores
    them."""

    freeze_vision_tower: bool = config_field(
        "Keep the vision tower's weights as they are (its projector into the language model trains unless "
        "freeze_projector). Fine-tuning the tower rarely pays on small data and costs its activations' memory.",
        True,
        section="vision",
        common=True,
    )
    freeze_projector: bool = config_field(
        "Also keep the projector (vision features -> language model) frozen: only the language model trains.",
        False,
        section="vision",
    )
    on_bad_image: Literal["error", "skip"] = config_field(
        "An image that is missing, unreadable or larger than max_image_pixels, found when the data is prepared: stop "
        "with its file, row and image (error), or drop its row and count it (skip; summary.json's skipped_bad_image).",
        "error",
        section="vision",
    )
    max_image_pixels: int = config_field(
        "Refuse images with more pixels than this (a decompression bomb: a small file that decodes to gigabytes). "
        "The default is Pillow's warning threshold, about 9,500 x 9,500.",
        DEFAULT_MAX_IMAGE_PIXELS,
        bounds="[1, inf)",
        section="vision",
    )
    image_dir: str | None = config_field(
        "The folder relative image paths are read from (LLaVA-style data names its images relative to an image "
        "folder). Unset: the data file's own folder.",
        None,
        section="vision",
    )
    cache_pixel_values: bool = config_field(
        "Store the image processor's outputs in the data cache at preparation (the loader's workers then read arrays "
        "instead of decoding images): faster when decoding is the bottleneck, at many times the images' disk size.",
        False,
        section="vision",
    )
    min_pixels: int | None = config_field(
        "Qwen-VL style processors: resize each image to at least this many pixels (its image processor's "
        "size.shortest_edge). Unset: the processor's own.",
        None,
        bounds="[1, inf)",
        section="vision",
    )
    max_pixels: int | None = config_field(
        "Qwen-VL style processors: resize each image to at most this many pixels (size.longest_edge); fewer pixels, "
        "fewer image tokens (one per 28 x 28). Unset: the processor's own (a tiny model's: 64 x 64).",
        None,
        bounds="[1, inf)",
        section="vision",
    )


def check_vision_keys(config: Any) -> None:
    """min_pixels at most max_pixels."""
    if config.min_pixels is not None and config.max_pixels is not None and config.min_pixels > config.max_pixels:
        raise ConfigError(f"min_pixels {config.min_pixels} is more than max_pixels {config.max_pixels}")


def check_image_dir(config: Any) -> None:
    """image_dir, where set, is a folder that exists (a file check: run by `check_files`, as the data files' are)."""
    if config.image_dir is not None and not Path(config.image_dir).expanduser().is_dir():
        raise ConfigError(f"image_dir: folder not found: {config.image_dir}")
