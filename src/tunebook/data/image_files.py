"""An image reference, and how its file is read: resolved (`image_reference`), its size read from the header
(`image_size`), decoded in a DataLoader worker (`open_image`). Every failure is one `DataError` naming the row and
the image, `where` being the row's file and row (`tunebook.data.images` says where a bad image is skipped).

A reference is datasets.Image's storage, `{"path": str | None, "bytes": bytes | None}`: an absolute path, an
http(s) URL (downloaded when opened, never offline), or the image's bytes (a `datasets.Image` value, a PIL image
stored as PNG, base64). Nothing here needs a model, a processor, numpy or torchvision.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import os
import re
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import DataError, first_line

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "base64_image",
    "image_reference",
    "image_size",
    "open_image",
    "open_images",
]

# Pillow's own warning threshold (its error is at twice this): about 9,500 x 9,500. The guard against a
# decompression bomb, a small file that decodes to gigabytes; VLM processors downscale far below it anyway.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
URL_TIMEOUT_SECONDS = 10.0  # per connection attempt and per read: an unreachable host fails, never hangs
MAX_URL_BYTES = 64 << 20


# --------------------------------------------------------------------------------------------------------------
# References


def image_reference(value: Any, base_dir: str | Path | None = None, where: str = "image") -> dict[str, Any]:
    """Any supported image value -> `{"path": str | None, "bytes": bytes | None}` (datasets.Image's storage).

    A relative path resolves against `base_dir` (the working directory when None) to an absolute one; a URL and a
    `datasets.Image` value's path beside its bytes are kept as they are; a PIL image becomes PNG bytes (lossless).
    Nothing is opened here: `image_size` and `open_image` read the files.
    """
    if value is None:
        raise DataError(f"{where}: the image is missing (null)")
    if isinstance(value, Image.Image):
        return {"path": None, "bytes": _png_bytes(value)}
    if isinstance(value, bytes | bytearray | memoryview):
        return {"path": None, "bytes": bytes(value)}
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return {"path": value.get("path"), "bytes": bytes(value["bytes"])}
        if value.get("path") is not None:
            return image_reference(value["path"], base_dir, where)
        raise DataError(f"{where}: an image with neither bytes nor a path: {value!r:.100}")
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: the image path is empty")
        if value.startswith("data:"):
            return {"path": None, "bytes": base64_image(value, where)}
        if _is_url(value):
            return {"path": value, "bytes": None}
        path = Path(value).expanduser()
        if not path.is_absolute():
            path = Path(base_dir if base_dir is not None else Path.cwd()) / path
        return {"path": os.path.abspath(path), "bytes": None}
    raise DataError(f"{where}: an image must be a path, a URL, a datasets.Image value or a PIL image, got "
                    f"{type(value).__name__} {value!r:.80}")  # fmt: skip


def _png_bytes(image: Image.Image) -> bytes:
    if image.mode not in ("1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"):  # CMYK, YCbCr, ...: no PNG of their own
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _is_url(text: str) -> bool:
    return re.match(r"https?://", text, re.IGNORECASE) is not None


def base64_image(value: Any, where: str) -> bytes:
    """The bytes of an image given as base64 text (a `data:` URI or bare)."""
    text = value.split(",", 1)[1] if isinstance(value, str) and value.startswith("data:") else value
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise DataError(f"{where}: an image given as base64 is not base64: {value!r:.60}") from None


# --------------------------------------------------------------------------------------------------------------
# Sizes and opening


class _BadImage(Exception):
    """Why an image cannot be used; `_opened` turns it into the DataError that names the row."""


def image_size(
    reference: dict[str, Any], where: str = "image", max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> tuple[int, int]:
    """(width, height) as the model will see the image, read from its header without decoding it: after the EXIF
    orientation that `open_image` applies (a phone's portrait photo is stored on its side). Raises a DataError
    naming `where` and the image when it is missing, unreadable or has more than `max_pixels` pixels."""
    with _opened(reference, where, max_pixels) as image:
        width, height = image.size
        if "exif" in image.info and image.getexif().get(0x0112) in (5, 6, 7, 8):  # rotated by 90 degrees
            return height, width
        return width, height


def open_image(
    reference: dict[str, Any], where: str = "image", max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> Image.Image:
    """The image decoded as RGB, turned upright by its EXIF orientation, transparency on white (as transformers'
    `load_image` and `convert_to_rgb` do): what a collator calls in a DataLoader worker. Any failure is a DataError
    naming `where` and the image, whatever `on_bad_image` says: the row passed `check_images`, so the file changed
    since or is damaged past its header."""
    with _opened(reference, where, max_pixels) as image:
        image = ImageOps.exif_transpose(image)
        if image.mode == "RGB":
            return image
        if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
            image = image.convert("RGBA")
            return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255)), image).convert("RGB")
        return image.convert("RGB")


def open_images(
    references: list[dict[str, Any]], where: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> list[Image.Image]:
    """A row's images, in order (`open_image`); `where` names the row, the message adds the image's number."""
    return [open_image(r, f"{where}, image {k}", max_pixels) for k, r in enumerate(references, 1)]


@contextmanager
def _opened(reference: dict[str, Any], where: str, max_pixels: int) -> Iterator[Image.Image]:
    """The image opened lazily (Pillow has read its header only), its pixel count checked; every failure, also of
    what the caller does with it (a decode), as one DataError naming `where` and the image."""
    name = _name(reference)
    try:
        with Image.open(_readable(reference)) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise _BadImage(f"{width}x{height} is {width * height:,} pixels, more than max_image_pixels "
                                f"({max_pixels:,})")  # fmt: skip
            yield image
    except _BadImage as error:
        raise DataError(f"{where} ({name}): {error}") from None
    except UnidentifiedImageError:
        raise DataError(f"{where} ({name}): not an image file Pillow can read") from None
    except Image.DecompressionBombError as error:
        raise DataError(f"{where} ({name}): too large: {first_line(error)}") from None
    except (OSError, SyntaxError, ValueError) as error:  # Pillow raises all three on damaged files
        raise DataError(f"{where} ({name}): could not be read: {first_line(error)}") from None


def _name(reference: dict[str, Any]) -> str:
    if reference.get("bytes") is not None:
        size = f"{len(reference['bytes']):,} bytes"
        return f"{reference['path']}, embedded, {size}" if reference.get("path") else f"embedded, {size}"
    return str(reference.get("path"))


def _readable(reference: dict[str, Any]) -> io.BytesIO | Path:
    if reference.get("bytes") is not None:
        return io.BytesIO(reference["bytes"])
    path = reference.get("path")
    if not path:
        raise _BadImage("neither bytes nor a path")
    if _is_url(path):
        return io.BytesIO(_download(path))
    file = Path(path)
    if not file.exists():
        raise _BadImage("not found")
    if file.is_dir():
        raise _BadImage("a folder, not an image file")
    return file


_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def _download(url: str) -> bytes:
    offline = next(
        (v for v in _OFFLINE_VARIABLES if os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")), None
    )
    if offline:
        raise _BadImage(f"a URL, and {offline}=1 keeps this run offline; download the images and give their paths")
    try:
        with urllib.request.urlopen(url, timeout=URL_TIMEOUT_SECONDS) as response:
            data = response.read(MAX_URL_BYTES + 1)
    except (OSError, http.client.HTTPException) as error:  # URLError, a timeout, a dropped connection
        raise _BadImage(f"could not be downloaded: {first_line(error)}") from None
    if len(data) > MAX_URL_BYTES:
        raise _BadImage(f"more than {MAX_URL_BYTES >> 20} MiB to download")
    return data
