"""Model FLOPs per token, the device's peak FLOP/s, and model FLOPs utilisation (MFU).

MFU = model FLOPs per token x tokens per second / peak dense bf16 FLOP/s of the device. Model FLOPs are what the
model needs (PaLM, appendix B): 6 x the multiply-accumulates of every linear layer (forward + backward) plus the
attention scores and their weighted sum, 12 x layers x heads x head_dim x T per token; recomputation from
gradient checkpointing is not counted, so turning it on lowers MFU.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

__all__ = [
    "PEAK_FLOPS",
    "attention_span",
    "dataset_flop_shape",
    "device_peak_flops",
    "mfu",
    "model_flops_per_token",
]

# Peak dense (no sparsity) bf16/fp16 tensor-core FLOP/s from the vendors' data sheets, matched by a substring of
# torch.cuda.get_device_name(). More specific names first. Override with `peak_flops` in the config.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}


def model_flops_per_token(model: torch.nn.Module, seq_len: float, head_fraction: float = 1.0) -> float:
    """Training FLOPs per token of `model` at attention span `seq_len` (see `attention_span`).

    Linear layers are counted from the model itself (every `nn.Linear`, a tied LM head included), so gated and
    plain MLPs, grouped-query attention and classifier heads come out right for any architecture; the attention
    term uses the config's layers, heads and head size. The LM head counts for `head_fraction` of the tokens:
    Tunebook's causal-LM loss runs it only where a label is (`causal_lm_token_losses`), and logits nobody
    needs are not model FLOPs.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear_macs = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            linear_macs += module.in_features * module.out_features * (head_fraction if module is head else 1.0)
    # A vision-language model's attention term is its language model's; its tower's linear layers count per token
    # too (an approximation: they run per image patch, a few per token on image data).
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 6.0 * linear_macs + 12.0 * config.num_hidden_layers * heads * head_dim * seq_len


def attention_span(lengths: Iterable[int] | np.ndarray) -> float:
    """The T of the attention term: sum(l^2) / sum(l) over the examples (each token attends within its example).

    One full row of T tokens gives T; rows packed with short examples give far less than the row length, which
    is what attention restricted to each example costs.
    """
    lengths = np.asarray(list(lengths) if not isinstance(lengths, np.ndarray) else lengths, dtype=np.float64)
    return float((lengths**2).sum() / lengths.sum()) if lengths.size and lengths.sum() > 0 else 0.0


def dataset_flop_shape(dataset) -> tuple[float, float]:
    """(`attention_span`, fraction of tokens with a label) of a prepared data set, read from its Arrow columns.

    Examples are the packed `seq_lengths` when present, else the rows of every `*input_ids` column (both
    responses of preference pairs), or of `prompt_ids` (GRPO's prompts, whose completions are not known yet); the label fraction is 1 unless the `*labels` columns are per-token (-100
    marks a position without loss).
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    table = dataset.data
    if "seq_lengths" in table.column_names:
        lengths = [pc.list_flatten(table.column("seq_lengths"))]
    else:
        lengths = [pc.list_value_length(table.column(c)) for c in table.column_names
                   if c.endswith("input_ids") or c == "prompt_ids"]  # fmt: skip
    lengths = np.concatenate([np.asarray(part.to_numpy(zero_copy_only=False)) for part in lengths])
    span = attention_span(lengths)
    labels = [c for c in table.column_names if c.endswith("labels") and pa.types.is_list(table.column(c).type)]
    if not labels:
        return span, 1.0
    flat = [pc.list_flatten(table.column(c)) for c in labels]
    labelled = sum(pc.sum(pc.not_equal(part, -100)).as_py() or 0 for part in flat)
    return span, labelled / max(sum(len(part) for part in flat), 1)


def device_peak_flops(device: torch.device | str, override: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of `device`: `override` if given, the table's entry for a CUDA GPU, else None."""
    if override:
        return float(override)
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


def mfu(flops_per_token: float, tokens_per_second: float, num_devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation of `num_devices` devices of `peak` FLOP/s each (None when the peak is unknown)."""
    if not peak or tokens_per_second <= 0:
        return None
    return flops_per_token * tokens_per_second / (peak * num_devices)
