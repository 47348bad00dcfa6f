"""The config checks: one plain function per rule, each taking a config and raising a `ConfigError` that names the key
and value at fault.

Each config class's `validate` runs a flat tuple of these in a fixed order: the shared tuples below, then the
recipe's own checks. The order is what a config with two faults reports first, so a new check goes where its
message should win. No check imports torch or the data code: a command line is checked before either loads.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..locations import PACKAGE_PREFIX, list_checkpoints, looks_like_local_data, looks_like_local_path, package_model
from ..user_code import load_function
from .fields import check_bounds

__all__ = [
    "BUILTIN_REWARDS",
    "MODEL_DATA_CHECKS",
    "TRACKERS",
    "TRAINING_CHECKS",
    "check_data_files",
    "check_output_dir",
    "report_to_names",
]

TRACKERS = ("tensorboard", "trackio", "wandb", "mlflow")  # each installs as the package of its name

# GRPO's built-in reward functions (tunebook.rl.rewards), named here so a config is checked without torch.
BUILTIN_REWARDS = ("exact_match", "format_regex", "length_penalty")


def report_to_names(report_to: str | list[str]) -> list[str]:
    """The names in a `report_to` value (a name, a comma-separated string or a list), checked: each one a tracker of
    `TRACKERS`, `auto` or `none`, and `none` alone. Whether they are installed is `tunebook.run.trackers`' question."""
    names = report_to if isinstance(report_to, list) else str(report_to).split(",")
    names = [str(n).strip().lower() for n in names if str(n).strip()]
    for name in names:
        if name not in (*TRACKERS, "auto", "none"):
            raise ConfigError(
                f"report_to: unknown tracker {name!r}; choose from {', '.join(TRACKERS)}, auto or none (or a list)"
            )
    if "none" in names and len(names) > 1:
        raise ConfigError(f"report_to: 'none' cannot be combined with trackers, got {report_to!r}")
    return names


def _streamed(spec) -> bool:
    """Whether a train_data/eval_data value streams any source (checked here without loading the data code)."""
    items = spec if isinstance(spec, list) else [spec]
    return any(isinstance(item, dict) and item.get("streaming") is True for item in items)


def _data_paths(spec) -> list[str]:
    """The paths a train_data/eval_data value names (read here without loading the data code)."""
    items = spec if isinstance(spec, list) else [] if spec is None else [spec]
    return [str(item["path"]) if isinstance(item, dict) else item for item in items
            if isinstance(item, str) or (isinstance(item, dict) and item.get("path") is not None)]  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Every recipe (TrainConfig's keys)


def check_field_bounds(config: Any) -> None:
    """Each numeric key within the bounds declared with its field (a config built directly was never coerced)."""
    for f in dataclasses.fields(config):
        check_bounds(f.name, getattr(config, f.name), f.metadata.get("bounds"))


def check_best_model_has_evaluations(config: Any) -> None:
    wants_best = config.load_best_model_at_end or config.early_stopping_patience
    if wants_best and config.eval_strategy == "steps" and config.eval_steps == 0:
        key = "load_best_model_at_end" if config.load_best_model_at_end else "early_stopping_patience"
        raise ConfigError(f"{key} needs evaluations during training: set eval_steps > 0 or eval_strategy: epoch")


def check_report_to(config: Any) -> None:
    report_to_names(config.report_to)  # unknown trackers fail now; one not installed when the run starts


def check_epochs(config: Any) -> None:
    if config.max_steps == -1 and config.num_train_epochs <= 0:
        raise ConfigError(f"num_train_epochs must be > 0 when max_steps is -1, got {config.num_train_epochs}")


def check_output_dir(config: Any) -> None:
    """The output_dir a run writes can be one: not a file, and holding no earlier run's checkpoints unless the run
    resumes them or `overwrite_output_dir` deletes them (the two runs would mix, and `latest` would later resume the
    old one). It reads and writes nothing else: `tunebook train` runs it before the launch, after the checks of the
    run's inputs (a missing input is named first), and `start_run` before it creates anything."""
    output_dir = Path(config.output_dir).expanduser()
    blocker = next((p for p in [output_dir, *output_dir.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        where = "" if blocker == output_dir else f": {blocker}"
        raise ConfigError(f"output_dir {config.output_dir}{where} is a file, not a directory")
    found = list_checkpoints(output_dir)
    if found and config.resume_from_checkpoint is None and not config.overwrite_output_dir:
        raise ConfigError(
            f"output_dir {config.output_dir} holds checkpoints of an earlier run (newest: {found[-1].name}); continue "
            "it with --resume_from_checkpoint latest, start over with --overwrite_output_dir true (deletes them), or "
            "choose another output_dir"
        )


def check_push_to_hub(config: Any) -> None:
    if config.push_to_hub and not config.hub_model_id:
        raise ConfigError("push_to_hub needs hub_model_id, the repository to upload to ('name' or 'org/name')")


def check_hub_model_id(config: Any) -> None:
    if config.hub_model_id is not None and not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", config.hub_model_id):
        raise ConfigError(f"hub_model_id must be 'name' or 'org/name', got {config.hub_model_id!r}")


# --------------------------------------------------------------------------------------------------------------
# Recipes with a model and data (ModelDataConfig's keys)


def check_eval_split(config: Any) -> None:
    if config.eval_split_ratio > 0 and config.eval_data is not None:
        raise ConfigError("set eval_data or eval_split_ratio, not both")


def check_one_model_source(config: Any) -> None:
    if config.model_name_or_path and config.model_config:
        raise ConfigError("set model_name_or_path (load weights) or model_config (fresh model), not both")


def check_model_paths(config: Any) -> None:
    """A local model or tokenizer path exists and is a directory (a Hub name is left to the loading code)."""
    for key, what, marker in (
        ("model_name_or_path", "model", "config.json"),
        ("tokenizer_name_or_path", "tokenizer", "tokenizer_config.json"),
    ):
        value = getattr(config, key)
        if value and value.startswith(PACKAGE_PREFIX):
            package_model(value)  # an installed package holding one model, or one line saying what it holds
            continue
        if value and looks_like_local_path(value) and not Path(value).expanduser().exists():
            raise ConfigError(f"{what} path not found: {value} ({key})")
        if value and Path(value).expanduser().is_file():
            gguf = "; convert a .gguf file with `tunebook convert-gguf`" if value.endswith(".gguf") else ""
            raise ConfigError(f"{key} {value} is a file, not a {what} directory (a folder with {marker}) or a "
                              f"Hub name{gguf}")  # fmt: skip


def check_peft_options(config: Any) -> None:
    for key in ("merge_adapter", "load_in_4bit"):
        if getattr(config, key) and not config.use_peft:
            raise ConfigError(f"{key}: true needs use_peft: true")


def check_load_in_4bit_has_weights(config: Any) -> None:
    if config.load_in_4bit and not config.model_name_or_path:
        raise ConfigError("load_in_4bit quantises pretrained weights: set model_name_or_path")


def check_eval_data_not_streamed(config: Any) -> None:
    if _streamed(config.eval_data):
        raise ConfigError("eval_data: streaming: true is for train_data; evaluation data is read whole, and cached")


def check_streamed_training(config: Any) -> None:
    """What a streamed train_data cannot honour: it has no length, so no epochs to count or split."""
    if not _streamed(config.train_data):
        return
    if not config.streams:
        raise ConfigError("train_data: streaming: true is read by the pretrain and sft recipes; remove it here")
    if config.max_steps < 0:
        raise ConfigError(f"max_steps={config.max_steps} with streaming: true: a stream's length is not known, so "
                          "num_train_epochs cannot be counted; set max_steps")  # fmt: skip
    if config.eval_split_ratio > 0:
        raise ConfigError("eval_split_ratio with streaming: true: a stream cannot hold out a fraction of rows "
                          "it has not read; give eval_data")  # fmt: skip
    for key in ("save_strategy", "eval_strategy"):
        if getattr(config, key) == "epoch":
            raise ConfigError(f"{key}: epoch with streaming: true: a stream's epochs are not known in steps; use "
                              "steps")  # fmt: skip


def check_data_files(config: Any) -> None:
    """Every local train_data/eval_data path (a list's entries and mappings' `path`s too) exists; Hub data set
    names ("name", "org/name") are not checked here. Run by `load_config` after `validate`, not by `validate`."""
    for key in ("train_data", "eval_data"):
        for path in _data_paths(getattr(config, key)):
            if looks_like_local_data(path) and not Path(path).expanduser().exists():
                raise ConfigError(f"{key}: data file or folder not found: {path}")


# --------------------------------------------------------------------------------------------------------------
# One recipe's keys


def check_sample_prompts(config: Any) -> None:  # sft, pretrain, dpo, grpo
    for position, prompt in enumerate(config.sample_prompts, 1):
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"sample_prompts: item {position} must be a non-empty string, got {prompt!r} (quote "
                              "prompts that YAML would read as numbers: --sample_prompts '[\"12345\"]')")  # fmt: skip
    evaluates = config.train_data is None or config.eval_data is not None or config.eval_split_ratio > 0
    if config.sample_prompts and not evaluates:
        raise ConfigError("sample_prompts are answered at each evaluation, and this run has no eval data: set "
                          "eval_data or eval_split_ratio")  # fmt: skip


def check_eval_harness(config: Any) -> None:  # the causal-LM recipes (CausalLMConfig)
    for position, name in enumerate(config.eval_harness_tasks, 1):
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"eval_harness_tasks: item {position} must be a task name or a task YAML path, got "
                              f"{name!r}")  # fmt: skip
    if config.eval_harness_at_eval and not config.eval_harness_tasks:
        raise ConfigError("eval_harness_at_eval runs the harness tasks at each evaluation: set eval_harness_tasks")


def check_harness_tasks(config: Any) -> None:  # the causal-LM recipes' check_files
    """Each of eval_harness_tasks is a local task YAML (or a directory of them) or in lm-eval's registry, and lm-eval
    is installed: checked with the files, so that `tunebook plan` of such a config needs neither."""
    if config.eval_harness_tasks:
        from .harness import harness_tasks

        harness_tasks(config.eval_harness_tasks)


def check_streamed_group_by_length(config: Any) -> None:  # sft
    if _streamed(config.train_data) and config.group_by_length:
        raise ConfigError("group_by_length with streaming: true: a stream's lengths are not known ahead to group "
                          "by; pack instead (packing: true)")  # fmt: skip


def check_split_turns(config: Any) -> None:  # sft
    if config.split_turns and not config.assistant_only_loss:
        raise ConfigError("split_turns: true with assistant_only_loss: false would train on a conversation's "
                          "earlier turns once for every later turn; set assistant_only_loss: true")  # fmt: skip


def check_label_names(config: Any) -> None:  # classify
    if config.label_names is not None and len(set(config.label_names)) != len(config.label_names):
        raise ConfigError(f"label_names has duplicates: {config.label_names}")
    if config.label_names is not None and len(config.label_names) < 2:
        raise ConfigError(f"label_names needs at least 2 classes, got {config.label_names}")


def check_label_smoothing(config: Any) -> None:  # dpo
    if config.label_smoothing and config.loss_type not in ("sigmoid", "robust"):
        raise ConfigError(f"label_smoothing applies to loss_type sigmoid or robust only, not {config.loss_type}")


def check_rpo_alpha(config: Any) -> None:  # dpo
    if config.rpo_alpha is not None and config.loss_type == "orpo":
        raise ConfigError("rpo_alpha does not apply to loss_type orpo: its loss already holds the chosen NLL")


def check_reference_to_precompute(config: Any) -> None:  # dpo
    if config.precompute_ref_log_probs and config.loss_type in ("simpo", "orpo"):
        raise ConfigError(f"precompute_ref_log_probs needs a reference model; loss_type {config.loss_type} has none")


def check_some_reward(config: Any) -> None:  # grpo
    if not config.reward_functions and not config.reward_model:
        raise ConfigError("GRPO needs at least one reward: reward_functions or reward_model")


def check_reward_functions(config: Any) -> None:  # grpo
    for spec in config.reward_functions:
        if spec not in BUILTIN_REWARDS and ":" not in spec:
            raise ConfigError(
                f"unknown reward function {spec!r}: use one of {', '.join(BUILTIN_REWARDS)}, or "
                "path/to/file.py:function_name for your own"
            )
        if spec not in BUILTIN_REWARDS:  # a file that is missing or does not import stops here, before torch
            load_function(spec, "reward function")


def check_tools(config: Any) -> None:  # grpo
    names = set()
    for spec in config.tools:
        if ":" not in spec:
            raise ConfigError(f"tool {spec!r}: expected path/to/file.py:function_name")
        load_function(spec, "tool")  # a missing file or function stops here; its definition at the run's start
        name = spec.rpartition(":")[2]
        if name in names:
            raise ConfigError(f"tools: two tools are named {name!r}; the model calls them by name")
        names.add(name)
    if config.environment is not None:
        if config.tools:
            raise ConfigError("environment and tools: give one (an environment's tools are its own `tools`)")
        if ":" not in config.environment:
            raise ConfigError(f"environment {config.environment!r}: expected path/to/file.py:factory")
        load_function(config.environment, "environment")
    if config.max_episode_tokens is not None and not (config.tools or config.environment):
        raise ConfigError("max_episode_tokens bounds multi-turn episodes, which need tools (or an environment); "
                          "set tools, or use max_new_tokens")  # fmt: skip


def check_reward_weights(config: Any) -> None:  # grpo
    rewards = len(config.reward_functions) + bool(config.reward_model)
    if config.reward_weights is not None and len(config.reward_weights) != rewards:
        raise ConfigError(
            f"reward_weights has {len(config.reward_weights)} values for {rewards} rewards "
            "(reward_functions, then reward_model); give one weight each"
        )


def check_reward_model(config: Any) -> None:  # grpo
    if config.reward_model and not (Path(config.reward_model).expanduser() / "config.json").is_file():
        raise ConfigError(
            f"reward_model {config.reward_model}: not a model directory (no config.json there); "
            "train one with recipes/reward.py"
        )


# --------------------------------------------------------------------------------------------------------------
# The checks several classes share, in the order they run


TRAINING_CHECKS = (
    check_field_bounds,  # first: a value out of bounds is named before any rule that combines keys
    check_best_model_has_evaluations,
    check_report_to,
    check_epochs,
    check_push_to_hub,
    check_hub_model_id,
)
MODEL_DATA_CHECKS = (
    check_eval_split,
    check_one_model_source,
    check_model_paths,
    check_peft_options,
    check_load_in_4bit_has_weights,
    check_eval_data_not_streamed,
    check_streamed_training,
)
