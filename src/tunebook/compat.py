"""Every use of another library's private attributes, in one place: one small function per use.

Where a library has no public way to do what a recipe needs, Tunebook reads or sets its private state here and
nowhere else (tests/unit/test_compat.py::test_no_private_access_outside_compat keeps it so). Each function names the
releases it was checked against; tests/unit/test_compat.py exercises each one against the installed library, so a
release that moves or renames the attribute fails there, by name, rather than somewhere inside a training run.

Checked against: Python 3.11.7, torch 2.13.0, accelerate 1.15.0, transformers 5.23.0, datasets 5.2.0.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = [
    "apply_liger_kernel_to_instance",
    "attn_implementation",
    "can_set_attn_implementation",
    "compiled_frames",
    "dtensor_type",
    "exit_callback_count",
    "fake_tensor_mode",
    "is_fake",
    "lm_eval_task_entry",
    "fingerprint",
    "forget_compiled_code",
    "has_recurrent_cache",
    "image_token_counts",
    "indices_mapping",
    "inner_of_compiled",
    "mark_dynamic",
    "model_from_config",
    "no_split_modules",
    "prepared_models",
    "prepared_optimizers",
    "prepared_schedulers",
    "run_exit_handlers",
    "set_last_lr",
    "set_sync_gradients",
    "shut_down_threads",
    "storage_key",
    "suppress_compile_errors",
    "torch_dispatch_mode",
]

# --------------------------------------------------------------------------------------------------------------
# accelerate


def set_sync_gradients(accelerator, sync: bool) -> None:
    """Tell Accelerate whether this micro-batch's backward syncs (reduces) gradients: `accumulate` decides it from
    its own counter, which counts differently from a window fetched whole. (accelerate 1.15.0:
    `GradientState._set_sync_gradients`.)"""
    accelerator.gradient_state._set_sync_gradients(sync)


def prepared_models(accelerator) -> list:
    """The models `accelerator.prepare` was given, in order (accelerate 1.15.0: `Accelerator._models`)."""
    return accelerator._models


def prepared_optimizers(accelerator) -> list:
    """The optimizers `accelerator.prepare` wrapped (accelerate 1.15.0: `Accelerator._optimizers`)."""
    return accelerator._optimizers


def prepared_schedulers(accelerator) -> list:
    """The schedulers `accelerator.prepare` wrapped, which `save_state` saves (accelerate 1.15.0:
    `Accelerator._schedulers`)."""
    return accelerator._schedulers


# --------------------------------------------------------------------------------------------------------------
# torch


def set_last_lr(scheduler, rates: list[float]) -> None:
    """Make `scheduler.get_last_lr()` return `rates` (set into the optimizer by hand): torch has a reader only
    (torch 2.13.0: `LRScheduler._last_lr`)."""
    scheduler._last_lr = list(rates)


def compiled_frames() -> tuple[int, int]:
    """(frames dynamo converted, frames it started) in this process so far: dynamo's own tally
    (torch 2.13.0: `torch._dynamo.utils.counters["frames"]`, keys "ok" and "total")."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"]), int(counters["frames"]["total"])


def forget_compiled_code(function) -> None:
    """Drop dynamo's compiled graphs of `function`'s code object only, as a fresh process would have none: past its
    recompile limit dynamo runs a code eagerly, and a notebook's earlier runs count. Other code keeps its graphs,
    unlike `torch.compiler.reset()`. (torch 2.13.0: `torch._C._dynamo.eval_frame.reset_code`.)"""
    import torch

    code = getattr(function, "__func__", function).__code__
    torch._C._dynamo.eval_frame.reset_code(code)


@contextlib.contextmanager
def suppress_compile_errors():
    """A context in which code dynamo fails to compile runs eagerly instead of raising: dynamo's `suppress_errors`,
    set for the context only (torch 2.13.0: `torch._dynamo.config.suppress_errors`; set and restored by hand, about
    seven times cheaper than `config.patch`, since it wraps every compiled block's call)."""
    from torch._dynamo import config

    setting = config.suppress_errors
    config.suppress_errors = True
    try:
        yield
    finally:
        config.suppress_errors = setting


def dtensor_type() -> type | None:
    """torch's DTensor class, or None in a build without it: public as `torch.distributed.tensor` from torch 2.5,
    private (`torch.distributed._tensor`) in 2.4, the oldest Tunebook supports (checked: torch 2.13.0, public)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def inner_of_compiled(module) -> Any:
    """The module `torch.compile(module)` wrapped, or None if `module` is not such a wrapper
    (torch 2.13.0: `torch._dynamo.eval_frame.OptimizedModule._orig_mod`)."""
    import sys

    dynamo = sys.modules.get("torch._dynamo")  # not loaded: nothing was compiled (and its import takes a while)
    if dynamo is not None and isinstance(module, dynamo.eval_frame.OptimizedModule):
        return module._orig_mod
    return None


def mark_dynamic(tensor, dim: int) -> None:
    """Let compiled code treat `tensor`'s size `dim` as dynamic from the first call, where dynamo can
    (torch 2.13.0: `torch._dynamo.maybe_mark_dynamic`)."""
    import torch

    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def fake_tensor_mode():
    """A mode in which tensors have shapes, dtypes and devices but no data: a model's step runs through every
    operator's shape rules in seconds, whatever its size (torch 2.13.0: `torch._subclasses.fake_tensor`; the
    public `torch.export` path needs a whole traced program, the planner runs eager code)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(tensor) -> bool:
    """Whether `tensor` is a fake tensor (shapes, no data) (torch 2.13.0: `torch._subclasses.fake_tensor.is_fake`)."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return fake(tensor)


def torch_dispatch_mode() -> type:
    """The base class of a mode that sees every operator call below autograd, its outputs included (torch 2.13.0:
    `torch.utils._python_dispatch.TorchDispatchMode`, documented as the `__torch_dispatch__` extension point)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def storage_key(tensor) -> int:
    """One number per storage a tensor's data lives in, the same for all its views and for data and fake tensors
    alike (`data_ptr()` is 0 for every fake or meta tensor) (torch 2.13.0: `UntypedStorage._cdata`)."""
    return tensor.untyped_storage()._cdata


# --------------------------------------------------------------------------------------------------------------
# transformers


def attn_implementation(config) -> str | None:
    """The attention implementation a model (its config) runs: transformers reads it this way itself and has no
    public reader (transformers 5.23.0: `PretrainedConfig._attn_implementation`)."""
    return getattr(config, "_attn_implementation", None)


def can_set_attn_implementation(model) -> bool:
    """Whether `model.set_attn_implementation` can switch it: its attention goes through transformers'
    AttentionInterface (transformers 5.23.0: `PreTrainedModel._can_set_attn_implementation`; older: assumed)."""
    check = getattr(model, "_can_set_attn_implementation", None)
    return True if check is None else bool(check())


def has_recurrent_cache(model) -> bool:
    """transformers' flag for a model whose cache holds recurrent state (state-space, convolution layers)
    (transformers 5.23.0: `PreTrainedModel._is_stateful`)."""
    return bool(getattr(model, "_is_stateful", False))


def no_split_modules(model) -> list[str]:
    """The class names of the blocks a model must keep whole when sharded, its repeated transformer blocks
    (transformers 5.23.0: `PreTrainedModel._no_split_modules`)."""
    return list(getattr(model, "_no_split_modules", None) or [])


def model_from_config(model_class, config, **kwargs) -> Any:
    """A model of `model_class` built from `config` as `from_config` builds one (dtype, DeepSpeed ZeRO-3's
    partitioned init): the Auto classes' `from_config` picks the class by the config, this keeps `model_class`
    (transformers 5.23.0: `PreTrainedModel._from_config`)."""
    return model_class._from_config(config, **kwargs)


def image_token_counts(processor, sizes: list[tuple[int, int]]) -> list[int]:
    """The image tokens a vision-language processor expands each image of `sizes` ((height, width), as decoded)
    into, as it computes them for its own placeholders (transformers 5.23:
    `ProcessorMixin._get_num_multimodal_tokens`, what vLLM reads; LLaVA's is the tower's fixed count)."""
    data = processor._get_num_multimodal_tokens(image_sizes=[list(s) for s in sizes])
    return [int(n) for n in data["num_image_tokens"]]


# --------------------------------------------------------------------------------------------------------------
# datasets


def indices_mapping(dataset):
    """The Arrow table mapping a `select`ed view's rows to its underlying table, or None for a plain dataset
    (datasets 5.2.0: `Dataset._indices`)."""
    return dataset._indices


def fingerprint(dataset) -> str:
    """The dataset's content fingerprint, as datasets' own caching names it (datasets 5.2.0: `Dataset._fingerprint`)."""
    return dataset._fingerprint


# --------------------------------------------------------------------------------------------------------------
# CPython


def shut_down_threads() -> None:
    """The interpreter's own thread shutdown, as at exit: the hooks that stop thread pools
    (`threading._register_atexit`, concurrent.futures'), then a join of every non-daemon thread
    (CPython 3.11.7: `threading._shutdown`; without it, the join alone)."""
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
        return
    for thread in threading.enumerate():  # pragma: no cover - a Python without the private hook
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()


def run_exit_handlers() -> None:
    """Run (and clear) the `atexit` handlers now, as the interpreter's exit would (CPython 3.11.7:
    `atexit._run_exitfuncs`)."""
    import atexit

    atexit._run_exitfuncs()


def exit_callback_count() -> int:
    """How many `atexit` handlers are registered (CPython 3.11.7: `atexit._ncallbacks`)."""
    import atexit

    return atexit._ncallbacks()


# --------------------------------------------------------------------------------------------------------------
# liger-kernel


def apply_liger_kernel_to_instance(model, **kernels) -> None:
    """Liger's kernels on this model instance (its public `apply_liger_kernel_to_<family>` patch the family's classes
    for the whole process): `liger_kernel.transformers._apply_liger_kernel_to_instance`. Not checked against a release
    here (liger-kernel is not installed where this was written: its test skips without it). Raises ImportError
    without the package."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, **kernels)


def lm_eval_task_entry(path) -> Any:
    """lm-eval's index entry for a task YAML file (its `name`), or None when the file names no task or group: what
    `TaskManager.load` reads the path as. A YAML of no known shape raises ValueError. From `TaskIndex.entry_from_path`
    in lm-eval's private `lm_eval.tasks._index` (lm-eval 0.4.13), which has no public counterpart: checking a config's
    task files before a run starts, without loading their data sets."""
    from lm_eval.tasks._index import TaskIndex

    return TaskIndex.entry_from_path(path)
