"""The devices a plan is made for: their memory as PyTorch sees it, and their peak dense bf16 FLOP/s."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError
from .flops import PEAK_FLOPS

__all__ = ["GPUS", "Hardware", "hardware", "parse_memory"]

GiB = 2**30

# Memory as `torch.cuda.get_device_properties(i).total_memory` reports it (what the allocator can ever have: a card
# sold as "80GB" is 79.1 GiB there), from the cards themselves where we have run (H100 SXM, H200) and the vendors'
# data sheets otherwise. The FLOP/s are `flops.PEAK_FLOPS`', matched by the part of the name before the size.
GPUS: dict[str, float] = {
    "H100-80GB": 79.1 * GiB,
    "H200-141GB": 139.8 * GiB,
    "B200-180GB": 178.4 * GiB,
    "A100-80GB": 79.1 * GiB,
    "A100-40GB": 39.4 * GiB,
    "L40S-48GB": 44.4 * GiB,
    "L4-24GB": 22.0 * GiB,
    "A10G-24GB": 22.0 * GiB,
    "RTX4090-24GB": 23.6 * GiB,
    "RTX3090-24GB": 23.6 * GiB,
    "T4-16GB": 14.6 * GiB,
    "V100-32GB": 31.7 * GiB,
    "V100-16GB": 15.8 * GiB,
}


@dataclass(frozen=True)
class Hardware:
    """What the plan is for: `count` devices of `memory` bytes each, `peak_flops` each (None: unknown)."""

    name: str
    memory: float
    count: int = 1
    peak_flops: float | None = None


def hardware(gpu: str | None = None, gpu_memory: str | None = None, num_gpus: int = 1) -> Hardware:
    """The `--gpu NAME` of `GPUS` or `--gpu_memory 24GiB` (then FLOP/s unknown unless the name is also given)."""
    if num_gpus < 1:
        raise ConfigError(f"--num_gpus must be at least 1, got {num_gpus}")
    if gpu is None and gpu_memory is None:
        gpu = "H100-80GB"
    memory = parse_memory(gpu_memory) if gpu_memory else None
    if gpu is not None:
        name = _known(gpu)
        peak = next((flops for key, flops in PEAK_FLOPS.items() if key.replace(" ", "") in name), None)
        return Hardware(name, memory or GPUS[name], num_gpus, peak)
    return Hardware(f"{gpu_memory} GPU", memory, num_gpus, None)


def _known(gpu: str) -> str:
    wanted = gpu.upper().replace(" ", "").replace("_", "-")
    matches = (
        [name for name in GPUS if name.upper() == wanted]
        or [name for name in GPUS if name.upper().split("-")[0] == wanted]  # H100, L4, A100 (two sizes: ambiguous)
        or [name for name in GPUS if name.upper().startswith(wanted)]
    )
    if len(matches) != 1:
        raise ConfigError(
            f"--gpu {gpu}: {'ambiguous' if matches else 'unknown'}; one of {', '.join(GPUS)}, or give --gpu_memory 24GiB"
        )
    return matches[0]


def parse_memory(text: str) -> float:
    """'24GiB', '80GB', '40 GiB', '16000MiB' -> bytes (GB and GiB both read as GiB: what users mean by a card's
    size is close enough either way, and a plan for 24 GiB on a 24 GB card leaves the same margin)."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?)?\s*", text, flags=re.IGNORECASE)
    if not found:
        raise ConfigError(f"--gpu_memory {text!r}: write a size such as 24GiB, 80GB or 16000MiB")
    value, unit = float(found.group(1)), (found.group(2) or "G").upper()[0]
    return value * {"K": 2**10, "M": 2**20, "G": GiB, "T": 2**40}[unit]
