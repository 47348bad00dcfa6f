"""Tunebook: readable, correct, fast fine-tuning recipes on Hugging Face Accelerate.

The recipes in `recipes/` are built from the functions re-exported here; import them to write your own loop.
"""

__version__ = "0.1.0"

from .checkpoint import list_checkpoints, save_checkpoint, save_final_model  # noqa: E402
from .config import TrainConfig, load_config, parse_config, save_config  # noqa: E402
from .errors import ConfigError, DataError, ModelError, TunebookError  # noqa: E402

__all__ = [
    "ConfigError",
    "DataError",
    "ModelError",
    "TrainConfig",
    "TunebookError",
    "__version__",
    "list_checkpoints",
    "load_config",
    "parse_config",
    "save_checkpoint",
    "save_config",
    "save_final_model",
]
