"""Every shipped YAML parses: recipe configs into their dataclass, accelerate configs with Accelerate's classes."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ROOT

from tunebook.config import parse_config
from tunebook.recipe_configs import ClassifyConfig, DPOConfig, PretrainConfig, SFTConfig

RECIPE_CONFIGS = sorted((ROOT / "recipes" / "configs").rglob("*.yaml"))
CONFIG_CLASSES = {"sft": SFTConfig, "classify": ClassifyConfig, "pretrain": PretrainConfig, "dpo": DPOConfig}
ACCELERATE_CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


def test_all_configs_are_found():
    assert len(RECIPE_CONFIGS) >= 6
    assert {p.name for p in ACCELERATE_CONFIGS} >= {
        "cpu.yaml",
        "multi_cpu.yaml",
        "single_gpu.yaml",
        "multi_gpu.yaml",
        "fsdp.yaml",
        "deepspeed_zero2.yaml",
        "deepspeed_zero3.yaml",
        "multi_node.yaml",
    }


@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_config_parses(path: Path):
    task = path.relative_to(ROOT / "recipes" / "configs").parts[0]
    config = parse_config(CONFIG_CLASSES[task], config_file=path)
    assert path.read_text().startswith("#"), "each config opens with a comment giving its launch command"
    assert "tunebook train --config_file accelerate_configs/" in path.read_text().split("\n\n")[0]
    assert f" {task} " in path.read_text().split("\n\n")[0] or f" {task}\n" in path.read_text().split("\n\n")[0]
    assert config.output_dir


def _launch_env(path: Path) -> tuple[object, dict[str, str]]:
    """What `accelerate launch --config_file path` hands its processes: Accelerate's own parsing and checks."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "recipes/sft.py"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate's launch_command does before its DeepSpeed launcher
        fields = [*defaults.deepspeed_config, *(["mixed_precision"] if mixed_precision_from_config else [])]
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        return args, prepare_deepspeed_cmd_env(args)[1]
    return args, prepare_multi_gpu_env(args)


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_loads(path: Path, monkeypatch):
    """Loaded by Accelerate's config classes (unknown keys fail there), turned into the launch environment, and
    the FSDP / DeepSpeed plugins built from that environment as the launched processes would."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    config = load_config_from_file(str(path))
    assert config.num_processes >= 1 and config.num_machines >= 1
    text = path.read_text()
    assert text.startswith("#") and "accelerate launch --config_file accelerate_configs/" + path.name in text
    args, env = _launch_env(path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if path.name == "fsdp.yaml":
        from accelerate.commands.launch import launch_command_parser

        known = {a.dest for a in launch_command_parser()._actions}
        assert set(config.fsdp_config) <= known, "fsdp_config keys Accelerate does not know are silently ignored"
        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
        assert plugin.activation_checkpointing and plugin.state_dict_type.name == "SHARDED_STATE_DICT"
        assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    elif path.name.startswith("deepspeed_zero"):
        plugin = DeepSpeedPlugin()
        stage = int(path.stem[-1])
        assert plugin.zero_stage == stage and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
        assert plugin.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] == (
            stage == 3
        )
    elif path.name == "multi_node.yaml":
        assert args.num_machines == 2 and args.num_processes == 16 and args.multi_gpu
        edits = [line.split(":")[0] for line in text.splitlines() if "# EDIT" in line]
        assert {"num_machines", "num_processes", "machine_rank", "main_process_ip", "main_process_port"} <= set(edits)


def test_default_yaml_is_the_embedded_default():
    """The documented default must not drift from the dataclass defaults the recipe uses without --config."""
    from tunebook.models import TINY_LLAMA

    from_file = parse_config(SFTConfig, config_file=ROOT / "recipes/configs/sft/default.yaml")
    embedded = SFTConfig()
    assert from_file.model_config == TINY_LLAMA
    differing = {k for k in vars(embedded) if getattr(embedded, k) != getattr(from_file, k)}
    assert differing <= {"model_config", "max_seq_length", "generation_max_new_tokens"}


@pytest.mark.parametrize(
    "task, cls, model",
    [
        ("classify", ClassifyConfig, "TINY_BERT"),
        ("pretrain", PretrainConfig, "TINY_LLAMA"),
        ("dpo", DPOConfig, "TINY_LLAMA"),
    ],
)
def test_other_default_yamls_are_the_embedded_defaults(task, cls, model):
    import tunebook.models

    from_file = parse_config(cls, config_file=ROOT / f"recipes/configs/{task}/default.yaml")
    embedded = cls()
    assert from_file.model_config == getattr(tunebook.models, model)
    assert {k for k in vars(embedded) if getattr(embedded, k) != getattr(from_file, k)} == {"model_config"}
