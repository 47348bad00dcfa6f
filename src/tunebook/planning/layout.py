"""How a run spreads over its devices, read from an accelerate config file: the engine, what it shards over how
many processes, mixed precision, offload, the engine's own activation checkpointing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import ConfigError

__all__ = ["ENGINES", "Layout", "read_layout"]

ENGINES = ("single", "ddp", "fsdp2", "zero2", "zero3")


@dataclass(frozen=True)
class Layout:
    """`engine` over `processes` devices (`shard_over` of them share one copy of what is sharded: all of them, or
    one node's under FSDP2's hybrid sharding). `mixed_precision` is accelerate's ("no", "bf16", "fp16")."""

    engine: str = "single"
    processes: int = 1
    mixed_precision: str = "no"
    shard_over: int = 1
    reshard_after_forward: bool = True  # FSDP2: False keeps a layer's parameters gathered until its backward
    offload_params: bool = False
    offload_optimizer: bool = False
    activation_checkpointing: bool = False  # FSDP's fsdp_activation_checkpointing: the recipe's, from the engine

    @property
    def sharded(self) -> bool:
        return self.engine in ("fsdp2", "zero2", "zero3")

    def replace(self, **changes) -> Layout:
        from dataclasses import replace

        return replace(self, **changes)


def read_layout(path: str | Path | None, num_gpus: int | None = None, machines: int = 1) -> Layout:
    """The layout of accelerate config `path` (None: one device, no mixed precision, as `accelerate launch` without
    a config). `num_gpus` replaces its `num_processes` (the plan's devices), as `--num_processes` does at launch."""
    if path is None:
        processes = num_gpus or 1
        return Layout("ddp" if processes > 1 else "single", processes, "no", 1)
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as error:
        raise ConfigError(f"--config_file {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"--config_file {path}: not YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config_file {path}: an accelerate config is a mapping of keys")
    processes = int(num_gpus or raw.get("num_processes") or 1)
    machines = int(raw.get("num_machines") or machines)
    kind = str(raw.get("distributed_type", "NO")).upper()
    mixed = str(raw.get("mixed_precision", "no")).lower()
    if kind == "FSDP":
        fsdp = raw.get("fsdp_config") or {}
        if int(fsdp.get("fsdp_version", 1)) != 2:
            raise ConfigError(f"--config_file {path}: the planner knows FSDP2 (fsdp_version: 2), not FSDP1")
        strategy = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
        hybrid = "HYBRID" in strategy
        return Layout(
            "fsdp2",
            processes,
            mixed,
            shard_over=max(1, processes // machines) if hybrid else processes,
            reshard_after_forward=bool(fsdp.get("fsdp_reshard_after_forward", True)),
            offload_params=bool(fsdp.get("fsdp_offload_params", False)),
            offload_optimizer=bool(fsdp.get("fsdp_offload_params", False)),
            activation_checkpointing=bool(fsdp.get("fsdp_activation_checkpointing", False)),
        )
    if kind == "DEEPSPEED":
        ds = raw.get("deepspeed_config") or {}
        if "deepspeed_config_file" in ds:
            raise ConfigError(f"--config_file {path}: a deepspeed_config_file is not read by the planner; put "
                              "zero_stage and the offload devices in deepspeed_config")  # fmt: skip
        stage = int(ds.get("zero_stage", 2))
        if stage not in (2, 3):
            raise ConfigError(f"--config_file {path}: the planner knows ZeRO stages 2 and 3, not {stage}")
        return Layout(
            f"zero{stage}",
            processes,
            mixed,
            shard_over=processes,
            offload_params=str(ds.get("offload_param_device", "none")).lower() == "cpu",
            offload_optimizer=str(ds.get("offload_optimizer_device", "none")).lower() == "cpu",
        )
    if kind in ("MULTI_GPU", "MULTI_CPU", "MULTI_XPU") or processes > 1:
        return Layout("ddp" if processes > 1 else "single", processes, mixed, 1)
    return Layout("single", 1, mixed, 1)
