"""Typed, strict recipe configs: one dataclass per recipe, loaded from YAML and `--key value` overrides.

- `fields`: how a key is declared (`config_field`: help, default, bounds; `new_default`; `Bounds`);
- `parsing`: loading (`load_config`, `parse_config`: YAML with file and line, the command line, did-you-mean, type
  coercion, aliases) and the way back (`save_config`, `--help`);
- `checks`: the rules that tie keys together, one plain function each, run by each class's `validate` in a flat
  tuple;
- `shared`: the fields every recipe shares (`TrainConfig`, `ModelDataConfig`, `ChatModelConfig`) and the
  causal-LM recipes' (`CausalLMConfig`);
- `sft`, `classify`, `pretrain`, `dpo`, `kto`, `reward`, `grpo`, `distill`: each recipe's config class, named as its
  recipe file.

Everything a recipe, a notebook or a test needs is importable from `tunebook.config`. Nothing here imports torch:
a command line is checked before torch loads.
"""

from __future__ import annotations

from ..errors import ConfigError  # importable from here as it always was
from .checks import BUILTIN_REWARDS, TRACKERS, check_output_dir, report_to_names
from .classify import ClassifyConfig
from .distill import DistillConfig
from .dpo import DPOConfig
from .fields import Bounds, check_bounds, config_field, new_default, numeric_keys
from .grpo import GRPOConfig
from .kto import KTOConfig
from .parsing import (
    ALIASES,
    aliases_used,
    config_help,
    config_to_dict,
    load_config,
    parse_config,
    save_config,
    saved_recipe,
)
from .pretrain import PretrainConfig
from .reward import RewardConfig
from .sft import SFTConfig
from .shared import CausalLMConfig, ChatModelConfig, ModelDataConfig, TrainConfig

__all__ = [
    "ALIASES",
    "BUILTIN_REWARDS",
    "TRACKERS",
    "Bounds",
    "CausalLMConfig",
    "ChatModelConfig",
    "ClassifyConfig",
    "ConfigError",
    "DPOConfig",
    "DistillConfig",
    "GRPOConfig",
    "KTOConfig",
    "ModelDataConfig",
    "PretrainConfig",
    "RewardConfig",
    "SFTConfig",
    "TrainConfig",
    "aliases_used",
    "check_bounds",
    "check_output_dir",
    "config_field",
    "config_help",
    "config_to_dict",
    "load_config",
    "new_default",
    "numeric_keys",
    "parse_config",
    "report_to_names",
    "save_config",
    "saved_recipe",
]
