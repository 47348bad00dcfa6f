"""The frozen reference model that DPO and GRPO measure the policy against, built and placed as the policy is."""

from __future__ import annotations

import copy
import logging

from .. import compat
from ..models.build import is_partitioned, whole_weights
from ..models.fused_cpu import fused_cpu_layers_of, set_fused_cpu_layers

__all__ = ["frozen_copy", "partition_reference"]

logger = logging.getLogger("tunebook")


def frozen_copy(model, device):
    """A frozen copy of `model` as its weights are now, on `device`: the reference DPO and GRPO measure against.
    Under DeepSpeed ZeRO-3 (call it inside `whole_weights(model)`), a deep copy would hold every weight whole on every
    process, with DeepSpeed's bookkeeping copied onto plain tensors: the copy is built anew from the model's config,
    partitioned as the policy was (transformers' `zero.Init`), and the weights copied in; `partition_reference` then
    hands it to an engine of its own."""
    if not is_partitioned(model):
        return copy.deepcopy(model).requires_grad_(False).eval().to(device)
    reference = compat.model_from_config(type(model), copy.deepcopy(model.config), dtype=model.dtype)
    with whole_weights(reference):
        reference.load_state_dict(model.state_dict())
    set_fused_cpu_layers(reference, fused_cpu_layers_of(model))  # fused as the policy is (a deep copy keeps them)
    return reference.requires_grad_(False).eval().to(device)


def partition_reference(accelerator, reference):
    """The frozen reference, under DeepSpeed ZeRO-3, run by a DeepSpeed engine without an optimizer (as TRL does):
    each process keeps its share of the weights, and a forward gathers each layer as it runs, as for the policy.
    Call after `accelerator.prepare`, which fills in the DeepSpeed config. Elsewhere the module is returned as is."""
    if reference is None or not is_partitioned(reference):
        return reference
    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    engine, *_ = deepspeed.initialize(model=reference, config=config)
    engine.eval()  # the engine's returns None
    logger.info("Reference model: ZeRO-3 partitioned over %d process(es), %s parameters", accelerator.num_processes,
                f"{sum(p.ds_numel for p in reference.parameters()):,}")  # fmt: skip
    return engine
