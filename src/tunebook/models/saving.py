"""Saving tokenizers (and a vision-language model's processor) so that the saved folder loads the same way
anywhere."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

__all__ = ["LOADING_KWARGS", "save_processor", "save_tokenizer"]

# What transformers' `from_pretrained` records in a tokenizer's init_kwargs about how it was loaded (from a local
# folder, offline), which `save_pretrained` would write into tokenizer_config.json: a saved model would then tell
# whoever loads it, on another machine, that it is local and to be loaded from local files only.
LOADING_KWARGS = ("is_local", "local_files_only")


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, directory: str | Path) -> None:
    """`tokenizer.save_pretrained(directory)` without the loading flags (`LOADING_KWARGS`) in its config. A
    vision-language model's processor (what its run saves in the tokenizer's place) goes to `save_processor`."""
    if hasattr(tokenizer, "image_processor"):
        save_processor(tokenizer, directory)
        return
    for key in LOADING_KWARGS:
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(directory)


def save_processor(processor: ProcessorMixin, directory: str | Path) -> None:
    """`processor.save_pretrained(directory)` without the tokenizer's loading flags (`LOADING_KWARGS`); a
    Qwen-VL processor without a video processor (`tiny_processor`'s) is saved as its parts, which `save_pretrained`
    cannot do (transformers 5.23 reads `_auto_class` of every part, None included)."""
    for key in LOADING_KWARGS:
        processor.tokenizer.init_kwargs.pop(key, None)
    if "video_processor" not in processor.get_attributes() or processor.video_processor is not None:
        processor.save_pretrained(directory)
        return
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_tokenizer(processor.tokenizer, directory)
    config = processor.to_dict()
    # What a loader with torchvision builds the video processor from (AutoProcessor insists on one): the image
    # processor's settings under the family's video processor class, named as transformers itself infers it from an
    # image processor's (Qwen2VLImageProcessor -> Qwen2VLVideoProcessor).
    video = dict(config["image_processor"])
    video["video_processor_type"] = video.pop("image_processor_type").replace("ImageProcessor", "VideoProcessor")
    config["video_processor"] = video
    (directory / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if isinstance(processor.chat_template, str):
        (directory / "chat_template.jinja").write_text(processor.chat_template, encoding="utf-8")
