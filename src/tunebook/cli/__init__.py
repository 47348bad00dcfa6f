"""The `tunebook` command: `train` (accelerate launch with a config check first), `export`, `report`."""

from .main import main

__all__ = ["main"]
