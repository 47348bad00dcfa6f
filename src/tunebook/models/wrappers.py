"""The model inside the wrappers that distributed training and compilation put around it."""

from __future__ import annotations

import sys

import torch

from .. import compat

__all__ = ["look_for_deepspeed_only_once_imported", "unwrap"]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside its DDP, DataParallel, FSDP, DeepSpeed and `torch.compile` wrappers.

    What accelerate's `extract_model_from_parallel` (`accelerator.unwrap_model`) finds, without its costs: it looks
    up DeepSpeed's package metadata on every call (~0.8 ms, and the loss unwraps in every step) and imports DeepSpeed
    where it is installed (0.3 s before the first step) even in runs that do not use it. A DeepSpeed engine, an FSDP
    wrapper or a compiled model can only exist once its module was imported, so only then is it looked for. A
    compiled model comes out uncompiled (recipes compile regions, never the whole model). Where accelerate's is still
    called (`get_state_dict`, transformers' `save_pretrained`), `look_for_deepspeed_only_once_imported` spares the
    import.
    """
    wrappers: tuple[type, ...] = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    if "deepspeed" in sys.modules:
        wrappers += (sys.modules["deepspeed"].DeepSpeedEngine,)
    if "torch.distributed.fsdp" in sys.modules:
        wrappers += (sys.modules["torch.distributed.fsdp"].FullyShardedDataParallel,)
    while True:
        if (inner := compat.inner_of_compiled(model)) is not None:
            model = inner
        elif isinstance(model, wrappers):
            model = model.module
        else:
            return model


def look_for_deepspeed_only_once_imported() -> None:
    """Make accelerate's `extract_model_from_parallel` look for DeepSpeed's engine only once DeepSpeed was imported.

    It is behind `Accelerator.unwrap_model` and `get_state_dict` and transformers' `save_pretrained`, and imports
    DeepSpeed wherever the package is installed: 0.3 s of every run's final save, and DeepSpeed's "unable to detect"
    warning on a CPU. An engine can only exist once its module was imported (Accelerate imports it when a launch
    uses it), so nothing that is one is missed. Idempotent; the check is accelerate's own in every other respect.
    """
    try:  # a private module: an accelerate that moved the check keeps its own
        import accelerate.utils.other as other

        installed = other.is_deepspeed_available
    except (ImportError, AttributeError):
        return
    if getattr(installed, "only_once_imported", False):
        return

    def is_deepspeed_available() -> bool:
        return "deepspeed" in sys.modules and installed()

    is_deepspeed_available.only_once_imported = True
    other.is_deepspeed_available = is_deepspeed_available
