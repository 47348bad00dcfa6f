"""Which generation engine a GRPO config asks for (`use_vllm`, `vllm_mode`, `async_generation`): the backends
themselves are in `tunebook.rl.generation` (the interface, transformers) and `tunebook.rl.vllm_backends`."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .generation import GenerationBackend, TransformersBackend

__all__ = ["make_backend"]


def make_backend(config, model, accelerator, data, log) -> GenerationBackend:
    """The backend a GRPO config asks for (`use_vllm`, `vllm_mode`, `async_generation`)."""
    if getattr(config, "use_vllm", False):
        if data.processor is not None:
            raise ConfigError("use_vllm: prompts with images are not supported yet; set use_vllm: false")
        from .vllm_backends import make_vllm_backend  # vLLM imports only where it is asked for

        backend = make_vllm_backend(config, model, accelerator, data.tokenizer, log)
    else:
        snapshot = bool(getattr(config, "async_generation", False))
        if snapshot and _sharded(model):
            raise ConfigError(
                "async_generation with the transformers backend samples from a whole copy of the policy, which a "
                "sharded model (FSDP, DeepSpeed ZeRO-3) does not have: use vLLM (use_vllm: true) or drop async"
            )
        backend = TransformersBackend(model, accelerator.device, snapshot=snapshot)
    log.info("Generation: %s%s", backend.name, ", one step ahead (async)" if config.async_generation else "")
    return backend


def _sharded(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "ds_id") or hasattr(p, "full_tensor") for p in model.parameters())
