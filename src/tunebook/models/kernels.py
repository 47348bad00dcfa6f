"""`use_liger_kernel: true`: Liger's Triton kernels (RMSNorm, rotary embedding, SwiGLU) patched into the model.

Only the layers are patched: Liger's fused linear cross-entropy replaces the model's loss when labels are passed,
and the recipes never pass labels (`tunebook.training.loss` computes the loss at the loss positions only).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError

__all__ = ["apply_liger_kernel"]


def apply_liger_kernel(model: torch.nn.Module) -> None:
    """Patch `model` in place, or stop with what is missing (a CUDA GPU, the package, support for the model)."""
    if not torch.cuda.is_available():
        raise ConfigError(
            "use_liger_kernel: Liger's kernels are Triton kernels for CUDA GPUs and this machine has none; "
            "set use_liger_kernel: false"
        )
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        raise ConfigError("use_liger_kernel needs the liger-kernel package: pip install liger-kernel") from None
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ConfigError(
            f"use_liger_kernel: Liger has no kernels for model_type {model_type!r} (it has: "
            f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); set use_liger_kernel: false"
        )
    _apply_liger_kernel_to_instance(
        model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
