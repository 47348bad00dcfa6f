"""The `tunebook` command.

    tunebook prepare --config FILE.yaml [--key value ...]
    tunebook export CHECKPOINT OUT_DIR

`prepare` builds the tokenised (and packed) data caches exactly as `recipes/sft.py` with the same config would, without
loading model weights or starting training, prints what it built, and exits. Point `cache_dir` at a shared file
system and a CPU machine can prepare data for a GPU job. `export` turns any checkpoint (of any number of
processes) into a `from_pretrained`-ready model directory.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

__all__ = ["main", "prepare"]


USAGE = """usage: tunebook prepare --config FILE.yaml [--key value ...]
       tunebook export CHECKPOINT OUT_DIR

commands:
  prepare   build the tokenised (and packed) data caches of a recipe config, then exit
  export    write a Hugging Face model directory (safetensors + tokenizer) from a training checkpoint
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
    elif command == "export":
        if len(rest) != 2:
            print(f"tunebook: error: export takes CHECKPOINT OUT_DIR, got {rest}\n{USAGE}", file=sys.stderr)
            raise SystemExit(2)
        from .checkpoint import export_checkpoint

        print(f"exported {rest[0]} to {export_checkpoint(rest[0], rest[1])}")
    else:
        print(f"tunebook: error: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
