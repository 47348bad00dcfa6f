"""`cache_pixel_values: true`: the image processor's outputs stored in the data cache at preparation, so the
DataLoader's workers read arrays instead of decoding images.

Decoding and resizing is most of a worker's time for large JPEGs; cached pixel values trade it for disk (float32
pixel values are many times the size of compressed images: a 448 x 448 picture is ~2.4 MB) and for memory-mapped
reads. Off by default, as the issue's users mostly have more pictures than disk to spare.

A row's cached inputs are one entry per output of the image processor (`pixel_values`, Qwen-VL's `image_grid_thw`,
...): its name, dtype, shape and values flattened. The collator (`vision_collate.cached_image_inputs`) concatenates the rows' entries along the first
dimension, as the image processor does for a batch of images. The image-token check of the collator
(`vision_collate`) runs here, once, at preparation. Since the cache now holds what a file's pixels were, its key
covers every image file's modification time and size (`image_files_fingerprint`), not the header size alone.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import datasets
import torch

from .vision_collate import decoded_image_inputs  # the collator's own decode and check

__all__ = ["PIXEL_FEATURES", "add_pixel_values", "image_files_fingerprint"]

PIXEL_FEATURES = datasets.List({
    "name": datasets.Value("string"),
    "dtype": datasets.Value("string"),
    "shape": datasets.List(datasets.Value("int64")),
    "values": datasets.List(datasets.Value("float32")),
})  # fmt: skip


def image_files_fingerprint(dataset) -> str:
    """Hash of the modification time and size of every image file the rows name (embedded bytes are in the
    references' own fingerprint): a file rewritten in place, at the same size, changes it."""
    h = hashlib.sha256()
    for refs in dataset.data.column("images").to_pylist():
        for ref in refs:
            if ref.get("bytes") is None and ref.get("path"):
                stat = os.stat(ref["path"])
                h.update(f"{ref['path']}\0{stat.st_mtime_ns}\0{stat.st_size}\n".encode())
    return h.hexdigest()


def add_pixel_values(dataset, processor, max_image_pixels: int, key: str, scratch: Path, num_proc: int | None):
    """`dataset` (tokenised rows with image references) with a `pixel_inputs` column: each row's image processor
    outputs, checked against its image tokens. `key` is the cache entry's."""
    features = datasets.Features({**dataset.features, "pixel_inputs": PIXEL_FEATURES})
    return dataset.map(
        _pixel_inputs,
        fn_kwargs={"processor": processor, "max_image_pixels": max_image_pixels},
        features=features,
        num_proc=num_proc,
        cache_file_name=str(scratch / "pixels.arrow"),
        new_fingerprint=f"{key}-pixels",
        desc="Decoding images (cache_pixel_values)",
    )


def _pixel_inputs(row: dict[str, Any], processor, max_image_pixels: int) -> dict[str, Any]:
    ids = torch.tensor([row["input_ids"]])
    out = decoded_image_inputs(processor, [row], ids, max_image_pixels, mm_types=False)
    entries = []
    for name, value in out.items():
        value = torch.as_tensor(value)
        dtype = "int64" if not value.is_floating_point() else "float32"
        entries.append({"name": name, "dtype": dtype, "shape": list(value.shape),
                        "values": value.reshape(-1).to(torch.float32).numpy()})  # fmt: skip
    return {"pixel_inputs": entries}
