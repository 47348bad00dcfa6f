"""The policy's weights as an inference engine loads them: whole (gathered from FSDP2 or ZeRO-3 shards), under the
names of a plain Hugging Face checkpoint, with LoRA adapters merged in.

Every process must iterate (`engine_weights`) when the model is sharded: gathering is collective. The merge is
computed, not done in place: peft's `merge_adapter`/`unmerge_adapter` adds then subtracts B @ A from the base
weight, which in bf16 does not give the base back exactly, and after thousands of steps the drift would be trained
into the "frozen" base.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from ..models.lora import is_peft_model
from ..models.wrappers import unwrap

__all__ = ["engine_weights", "write_engine_model"]


def _gathered(policy: torch.nn.Module):
    """ZeRO-3: every parameter whole for the duration (one gather); otherwise nothing to do."""
    if any(hasattr(p, "ds_id") for p in policy.parameters()):
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(policy.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2) full value, on every process; anything else as it is."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach()


@torch.no_grad()
def engine_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for every weight of the policy as a plain checkpoint names it (a PEFT model's adapters
    merged, as `merge_and_unload` would). Collective under FSDP2 and ZeRO-3: call it on every process."""
    policy = unwrap(model)
    with _gathered(policy):
        if not is_peft_model(policy):
            for name, tensor in policy.state_dict().items():
                yield name, _whole(tensor)
            return
        yield from _merged(policy)


def _merged(peft_model) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's weights with each adapted module's merged weight in its place: a LoRA layer's base weight
    plus peft's own `get_delta_weight` (scaling, fan_in_fan_out), a trainable-tokens layer's
    `get_merged_weights`, a `modules_to_save` copy's trained weights."""
    adapter = peft_model.active_adapter
    base = peft_model.get_base_model()
    merged = {}
    for name, module in base.named_modules():
        if adapter in getattr(module, "lora_A", {}) and hasattr(module, "get_delta_weight"):
            weight = module.get_base_layer().weight
            delta = _whole(module.get_delta_weight(adapter)).to(weight.dtype)
            merged[_plain(f"{name}.weight", adapter)] = _whole(weight) + delta
        elif hasattr(module, "get_merged_weights") and adapter in getattr(module, "trainable_tokens_delta", {}):
            merged[_plain(f"{name}.weight", adapter)] = _whole(module.get_merged_weights([adapter]))
    for name, tensor in base.state_dict().items():
        if ".lora_" in name or ".trainable_tokens_" in name or ".original_module." in name:
            continue  # merged above; a modules_to_save copy replaces its original
        plain = _plain(name, adapter)
        yield plain, merged.get(plain, _whole(tensor))


def _plain(name: str, adapter: str) -> str:
    """A PEFT-wrapped weight's name in the plain model."""
    for wrapper in (".base_layer.", ".token_adapter.", f".modules_to_save.{adapter}."):
        name = name.replace(wrapper, ".")
    return name


def write_engine_model(model: torch.nn.Module, tokenizer, directory: str | Path) -> Path:
    """A Hugging Face model directory an engine can start from: config, generation config, tokenizer and the
    weights of `engine_weights` as safetensors (only the calling process writes; call `engine_weights`'s
    collective on every process by calling this on every process, with `directory` None on the others)."""
    from safetensors.torch import save_file

    policy = unwrap(model)
    base = policy.get_base_model() if is_peft_model(policy) else policy
    weights = {name: tensor.cpu().contiguous().clone() for name, tensor in engine_weights(model)}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if getattr(base.config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # tied: the engine ties it to the embeddings, as from_pretrained does
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    base.config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory
