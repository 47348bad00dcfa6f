"""The `tunebook` command.

    tunebook prepare --config FILE.yaml [--key value ...]
    tunebook export CHECKPOINT OUT_DIR
    tunebook convert-gguf MODEL.gguf OUT_DIR

`prepare` builds the tokenised (and packed) data caches exactly as `recipes/sft.py` with the same config would, without
loading model weights or starting training, prints what it built, and exits. Point `cache_dir` at a shared file
system and a CPU machine can prepare data for a GPU job. `export` turns any checkpoint (of any number of
processes) into a `from_pretrained`-ready model directory. `convert-gguf` dequantises a GGUF checkpoint into a
safetensors model directory (once; the recipes then load it with `model_name_or_path`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

__all__ = ["main", "prepare"]


USAGE = """usage: tunebook prepare --config FILE.yaml [--key value ...]
       tunebook export CHECKPOINT OUT_DIR
       tunebook convert-gguf MODEL.gguf OUT_DIR

commands:
  prepare   build the tokenised (and packed) data caches of a recipe config, then exit
  export    write a Hugging Face model directory (safetensors + tokenizer) from a training checkpoint
  convert-gguf  write a Hugging Face model directory (float32 safetensors + tokenizer) from a GGUF file
"""


def prepare(argv: list[str]) -> dict:
    """Build the caches an SFT run with these arguments would use; returns the printed figures."""
    from .config import load_config
    from .data import default_cache_dir, prepare_sft_data
    from .logging import setup_logging
    from .recipe_configs import SFTConfig

    start = time.perf_counter()
    config = load_config(SFTConfig, argv)
    log = setup_logging(True, config.log_level)
    cache_dir = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
    data = prepare_sft_data(config, cache_dir, log)
    figures = {
        "cache_dir": str(cache_dir),
        "train_rows": len(data.train),
        "train_tokens": data.stats["train_tokens_per_epoch"],
        "eval_rows": 0 if data.eval is None else len(data.eval),
        "packing_efficiency": data.stats.get("packing_efficiency"),
        "built": ", ".join(data.built) or "nothing (all cached)",
        "seconds": time.perf_counter() - start,
    }
    width = max(map(len, figures))
    for key, value in figures.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")
    return figures


def main(argv: list[str] | None = None) -> None:
    from .errors import install_excepthook

    install_excepthook()
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command == "prepare":
        prepare(rest)
    elif command in ("export", "convert-gguf"):
        if len(rest) != 2:
            what = "CHECKPOINT" if command == "export" else "MODEL.gguf"
            print(f"tunebook: error: {command} takes {what} OUT_DIR, got {rest}\n{USAGE}", file=sys.stderr)
            raise SystemExit(2)
        if command == "export":
            from .checkpoint import export_checkpoint as convert
        else:
            from .models.gguf import convert_gguf as convert
        print(f"wrote {convert(rest[0], rest[1])} from {rest[0]}")
    else:
        print(f"tunebook: error: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
