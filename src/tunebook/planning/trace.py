"""Bytes alive during a training step, counted operator by operator: on fake tensors for a plan (no data, any model
size, seconds), or on real ones to measure a step on a CPU, where PyTorch keeps no allocator statistics.

`PeakBytes` sees every tensor an operator returns (below autograd, so the backward's are seen too) and counts each
storage once, from its creation until Python frees it; its peak is what `torch.cuda.max_memory_allocated` would
say for the same tensors, without the caching allocator's rounding. Tensors that existed before the mode began
(weights, optimizer states) are not counted: a plan adds them from the parameter counts.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import compat

__all__ = ["PeakBytes", "Phase", "StepTrace", "measure_run", "trace_step"]


class PeakBytes(compat.torch_dispatch_mode()):
    """Live and peak bytes of the tensors operators create while the mode is on, by kind at the peak: `grads`
    (storages later assigned to a parameter's `.grad`, marked by `mark_grad`), `logits` (made while `kind` is
    "logits": the loss's logits, softmax and their gradient, a chunk of them) and the rest (activations and the
    backward's temporaries)."""

    def __init__(self, outside_dispatch: bool = False) -> None:
        super().__init__()
        self.kind = "other"  # what storages made from now on count as
        self.live = self.peak = 0
        # Measuring a real run (`measure_run`): storages made without an operator (`copy.deepcopy` copies storages
        # directly: a reference model) are seen at their first use as an operator's input, those that existed
        # before the meter began are left out, and fake tensors (the run's own plan at its start) are not memory.
        self.outside_dispatch = outside_dispatch
        self.before: set[int] = set()
        self.sizes: dict[int, tuple[int, str]] = {}
        self.kinds = {"grads": 0, "logits": 0, "other": 0}
        self.at_peak = dict(self.kinds)

    def __enter__(self):
        if self.outside_dispatch:
            import warnings

            with warnings.catch_warnings():  # isinstance on every object touches deprecated torch aliases
                warnings.simplefilter("ignore", FutureWarning)
                self.before = {compat.storage_key(t) for t in _live_tensors()}
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = _tensors(list(args) + list((kwargs or {}).values()))
        if self.outside_dispatch:
            for tensor in given:
                key = compat.storage_key(tensor)
                if key not in self.sizes and key not in self.before:
                    self._count(tensor)
        # An output on an input's storage (in place, a view) is no new memory, whether or not the input was counted.
        inputs = {compat.storage_key(t) for t in given}
        for tensor in _tensors(out):
            if compat.storage_key(tensor) not in inputs:
                self._count(tensor)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        key = compat.storage_key(tensor)
        if key in self.sizes or (self.outside_dispatch and compat.is_fake(tensor)):
            return
        storage = tensor.untyped_storage()
        size = storage.nbytes()
        kind = self.kind
        self.sizes[key] = (size, kind)
        self.live += size
        self.kinds[kind] += size
        weakref.finalize(storage, self._free, key)
        if self.live > self.peak:
            self.peak, self.at_peak = self.live, dict(self.kinds)

    def _free(self, key: int) -> None:
        size, kind = self.sizes.pop(key)
        self.live -= size
        self.kinds[kind] -= size

    def mark_grad(self, parameter: torch.Tensor) -> None:
        """Count `parameter.grad`'s storage as gradients from now on (it was made by the backward as any other)."""
        key = compat.storage_key(parameter.grad)
        if key in self.sizes and self.sizes[key][1] != "grads":
            size, kind = self.sizes[key]
            self.sizes[key] = (size, "grads")
            self.kinds[kind] -= size
            self.kinds["grads"] += size


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    return []


@dataclass(frozen=True)
class Phase:
    """The peak of a forward or a backward, and what was alive at it by kind."""

    peak: float
    activations: float
    logits: float
    grads: float


@dataclass(frozen=True)
class StepTrace:
    """One micro-batch's forward and backward: each phase's peak (the forward's end holds every saved tensor and,
    under autocast with checkpointing, every layer's cast weights; the backward's the recomputed layer and the
    gradients), and the gradients alive at the end (the trained parameters', in their dtype). The step's peak is
    the larger phase's."""

    forward: Phase
    backward: Phase
    grads: float

    @property
    def top(self) -> Phase:
        return self.forward if self.forward.peak > self.backward.peak else self.backward

    @property
    def peak(self) -> float:
        return self.top.peak


def trace_step(model: torch.nn.Module, run: Callable[[PeakBytes], torch.Tensor], keep_grads: bool,
               autocast: torch.dtype | None = None) -> StepTrace:  # fmt: skip
    """Run `run(meter)` (a micro-batch's forward, returning its loss; it sets `meter.kind` around its loss's
    logits) and its backward on `model` under `PeakBytes`.

    `keep_grads` False drops each gradient as soon as it is complete, as FSDP2 and ZeRO do after reducing it to
    their shard; the sharded gradients are then the plan's to add. `autocast` is the mixed-precision dtype the
    forward runs under (accelerate's autocast over float32 weights); its cast weights are activations here, as
    on the GPU, where autograd keeps them for the backward."""
    meter = PeakBytes()
    hooks = []
    for parameter in model.parameters():
        if parameter.requires_grad:
            hooks.append(parameter.register_post_accumulate_grad_hook(_after_grad(meter, keep_grads)))
    device = next(model.parameters()).device.type
    try:
        with meter:
            with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = run(meter)
            forward = _phase(meter)
            meter.peak, meter.at_peak = meter.live, dict(meter.kinds)  # the backward's own peak from here
            loss.backward()
            del loss
    finally:
        for hook in hooks:
            hook.remove()
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    return StepTrace(forward, _phase(meter), grads)


def _phase(meter: PeakBytes) -> Phase:
    at_peak = meter.at_peak
    return Phase(meter.peak, at_peak["other"], at_peak["logits"], at_peak["grads"])


def _after_grad(meter: PeakBytes, keep: bool):
    def hook(parameter: torch.Tensor) -> None:
        if keep:
            meter.mark_grad(parameter)
        else:
            parameter.grad = None

    return hook


def measure_run(recipe: str, config) -> PeakBytes:
    """Run `recipe`'s `main(config)` with every tensor it makes counted: its peak is the run's measured peak of
    allocated bytes, on a CPU, where `torch.cuda.max_memory_allocated` has no counterpart (tests and
    benchmarks/plan_accuracy.py hold plans against it). Slower than the run alone (each operator goes through
    Python); threads other than this one (async generation) are not counted."""
    from ..recipe import load_recipe

    meter = PeakBytes(outside_dispatch=True)
    with meter:
        load_recipe(recipe).main(config)
    return meter


def _live_tensors():
    """Every tensor the garbage collector tracks. A `weakref.proxy` whose object is gone (one left by an earlier
    run) raises ReferenceError on any attribute lookup, `isinstance`'s included: skipped."""
    import gc

    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor):
                yield obj
        except ReferenceError:
            continue
