"""`use_liger_kernel: true`: Liger's Triton kernels (RMSNorm, rotary embedding, SwiGLU) patched into the model; and
the limits of FlexAttention's kernels, checked before a first forward would fail inside inductor.

Only the layers are patched: Liger's fused linear cross-entropy replaces the model's loss when labels are passed,
and the recipes never pass labels (`tunebook.training.loss` computes the loss at the loss positions only).
"""

from __future__ import annotations

import torch

from .. import compat
from ..errors import ConfigError

__all__ = ["apply_liger_kernel", "check_flex_attention"]


def apply_liger_kernel(model: torch.nn.Module) -> None:
    """Patch `model` in place, or stop with what is missing (a CUDA GPU, the package, support for the model)."""
    if not torch.cuda.is_available():
        raise ConfigError(
            "use_liger_kernel: Liger's kernels are Triton kernels for CUDA GPUs and this machine has none; "
            "set use_liger_kernel: false"
        )
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        raise ConfigError("use_liger_kernel needs the liger-kernel package: pip install liger-kernel") from None
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ConfigError(
            f"use_liger_kernel: Liger has no kernels for model_type {model_type!r} (it has: "
            f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); set use_liger_kernel: false"
        )
    compat.apply_liger_kernel_to_instance(
        model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )


def check_flex_attention(model: torch.nn.Module, device: torch.device | str) -> None:
    """Stop with one line where a model set to `attn_implementation: flex_attention` cannot train on `device`."""
    from .wrappers import unwrap

    config = unwrap(model).config
    if compat.attn_implementation(config) != "flex_attention":
        return
    if torch.device(device).type == "cpu":
        raise ConfigError("attn_implementation flex_attention: PyTorch's FlexAttention has no backward pass on a CPU; "
                          "use sdpa (per-example attention on a CPU)")  # fmt: skip
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if head_dim < 16:  # inductor would stop in flex's first forward with a page of its IR (seen on an H100)
        raise ConfigError(f"attn_implementation flex_attention: FlexAttention's kernels need a head dimension of at "
                          f"least 16 and {type(unwrap(model)).__name__} has {head_dim}; use sdpa")  # fmt: skip
