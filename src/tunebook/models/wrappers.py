"""The model inside the wrappers that distributed training and compilation put around it."""

from __future__ import annotations

import sys

import torch

__all__ = ["unwrap"]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside its DDP, DataParallel, FSDP, DeepSpeed and `torch.compile` wrappers.

    What accelerate's `extract_model_from_parallel` (`accelerator.unwrap_model`) finds, without its costs: it looks
    up DeepSpeed's package metadata on every call (~0.8 ms, and the loss unwraps in every step) and imports DeepSpeed
    where it is installed (0.3 s before the first step) even in runs that do not use it. A DeepSpeed engine, an FSDP
    wrapper or a compiled model can only exist once its module was imported, so only then is it looked for. A
    compiled model comes out uncompiled (recipes compile regions, never the whole model). transformers'
    `save_pretrained` still unwraps with accelerate's, so a run whose environment has DeepSpeed imports it when it
    saves the final model.
    """
    wrappers: tuple[type, ...] = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    if "deepspeed" in sys.modules:
        wrappers += (sys.modules["deepspeed"].DeepSpeedEngine,)
    if "torch.distributed.fsdp" in sys.modules:
        wrappers += (sys.modules["torch.distributed.fsdp"].FullyShardedDataParallel,)
    compiled = sys.modules["torch._dynamo"].eval_frame.OptimizedModule if "torch._dynamo" in sys.modules else ()
    while True:
        if isinstance(model, compiled):
            model = model._orig_mod
        elif isinstance(model, wrappers):
            model = model.module
        else:
            return model
