"""Tunebook: readable, correct, fast fine-tuning recipes on Hugging Face Accelerate.

Run a recipe from Python with `load_recipe` (see `tunebook.recipe`), or write your own loop from the building
blocks the recipes use, all importable from here (loaded on first use, so `import tunebook` stays light):

- data: `load_source`, `parse_sources`, `prepare_sft_data`, `prepare_classification_data`, `prepare_text_data`,
  `prepare_preference_data`, `cached_dataset`, `pack_dataset`, `PackedCollator`, `PadCollator`, `PairCollator`,
  `build_loader`, `attention_inputs`;
- training: `recipe_accelerator`, `build_accelerator`, `build_optimizer`, `build_scheduler`,
  `accumulation_windows`, `count_loss_tokens`, `step_loss_scale`, `causal_lm_token_losses`, `token_loss_sum`,
  `Throughput`, `dpo_loss`, `preference_loss` (every DPO loss type), `sequence_log_probs`, `bradley_terry_loss`,
  `load_reward_model` (a trained reward model as a scoring function);
- the loop's bookkeeping: `start_run`, `plan_steps`, `load_checkpoint_or_start`, `start_training`, `epochs`,
  `after_step`, `finish` (`tunebook.training.loop`); the step's guard: `finite_on_every_process`,
  `optimizer_step_or_skip` (`tunebook.training.step`); `compile_model`;
- checkpoints: `save_checkpoint`, `resume_training`, `save_final_model`, `list_checkpoints`, `export_checkpoint`;
- evaluation: `evaluate_loss`, `generation_exact_match`, `evaluate_classifier`, `load_metric`;
- models: `build_causal_lm`, `build_sequence_classifier`, `train_chat_tokenizer`, `apply_lora`;
- the run summary every recipe returns: `run_summary`; its report: `render_report`, `compare_runs`.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

from .config import TrainConfig, load_config, parse_config, save_config  # noqa: E402
from .errors import ConfigError, DataError, ModelError, TunebookError  # noqa: E402
from .recipe import Recipe, load_recipe  # noqa: E402

# Loaded on first use: `import tunebook` (and checking a config) must not import torch.
_LAZY = {
    "tunebook.training.checkpoint": ["list_checkpoints", "save_checkpoint", "save_final_model"],
    "tunebook.training.resumption": ["resume_training"],
    "tunebook.run.export": ["export_checkpoint"],
    "tunebook.data": [
        "load_source", "parse_sources", "prepare_sft_data", "prepare_classification_data", "prepare_text_data",
        "cached_dataset", "pack_dataset", "PackedCollator", "PadCollator", "build_loader", "attention_inputs",
        "PairCollator",
    ],
    "tunebook.training": [
        "recipe_accelerator", "build_accelerator", "build_optimizer", "build_scheduler", "accumulation_windows",
        "count_loss_tokens", "step_loss_scale", "causal_lm_token_losses", "token_loss_sum", "Throughput",
    ],
    "tunebook.preference": [
        "prepare_preference_data", "dpo_loss", "sequence_log_probs", "bradley_terry_loss", "load_reward_model",
        "preference_loss",
    ],
    "tunebook.evaluation": ["evaluate_loss", "generation_exact_match", "evaluate_classifier", "load_metric"],
    "tunebook.models": ["build_causal_lm", "build_sequence_classifier", "train_chat_tokenizer", "apply_lora"],
    "tunebook.run.record": ["run_summary", "finish_run"],
    "tunebook.run.report": ["render_report", "compare_runs"],
}  # fmt: skip
_WHERE = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'tunebook' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "DataError",
    "ModelError",
    "Recipe",
    "TrainConfig",
    "TunebookError",
    "__version__",
    "load_config",
    "load_recipe",
    "parse_config",
    "save_config",
    *_WHERE,
]
