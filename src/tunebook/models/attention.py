"""Attention over packed rows: what keeps each example of a row from attending to the others, per backend.

A packed row (`tunebook.data.packing`) keeps the length of every example; the collator turns them into position ids
that restart at each example and segment ids. From these, `attention_inputs` builds each backend's input: nothing more
for flash varlen kernels (transformers derives the boundaries from the position ids), cumulative lengths for our CPU
varlen attention (`segment_sdpa_attention`, registered with transformers by `use_packed_attention`), a FlexAttention
block mask (`document_kv_blocks`, computed in the collator's workers, and `document_block_mask`), or an explicit
block-diagonal causal mask for sdpa and eager. `use_packed_attention` and `packing_mechanism` choose the backend and
`check_packable` refuses models whose layers cannot keep examples apart.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from .. import compat
from ..errors import ConfigError
from .kernels import check_flex_attention

__all__ = [
    "BLOCK_MASK_KEYS",
    "BLOCK_MASK_PREFIX",
    "IMAGE_INPUTS",
    "PACKABLE_VISION_FAMILIES",
    "SEGMENT_SDPA",
    "VARLEN_BACKENDS",
    "attention_inputs",
    "check_packable",
    "document_block_mask",
    "document_kv_blocks",
    "image_inputs",
    "packing_mechanism",
    "packing_refusal",
    "segment_sdpa_attention",
    "sliding_window",
    "use_packed_attention",
]

# What `PackedCollator` adds for FlexAttention: the `document_kv_blocks` tensors, batch first, under these names.
BLOCK_MASK_KEYS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
BLOCK_MASK_PREFIX = "block_mask_"

# The kernels that take packed sequences as position ids (cumulative lengths), without a mask.
VARLEN_BACKENDS = (
    "flash_attention_2",
    "flash_attention_3",
    "kernels-community/flash-attn",
    "kernels-community/flash-attn3",
)
# Our own varlen attention for CPUs (see `segment_sdpa_attention`); registered with transformers on first use.
SEGMENT_SDPA = "tunebook_segment_sdpa"
EXAMPLE_SIZES = "_tunebook_example_sizes"  # the attribute of `cu_seq_lens_q` that holds its examples' sizes


# Eager under torch_compile: the per-example split depends on the batch's lengths, which a graph would specialise on.
@torch.compiler.disable
def segment_sdpa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention run separately on every packed example: a varlen kernel for transformers' `sdpa` models.

    With a block-diagonal mask, SDPA computes the whole row's `length x length` scores and throws most of them
    away, and on CUDA a mask also rules out the flash kernel. Given the examples' boundaries (`cu_seq_lens_q` over
    the flattened batch, the flash-attention convention) this computes only what is kept: on CUDA in bf16/fp16
    with PyTorch's flash varlen kernel (`torch.nn.attention.varlen`), elsewhere with one causal SDPA call per
    example (about 1.7x faster per attention layer than the mask on a CPU for rows of ~4 examples).
    Batches without `cu_seq_lens_q` (padded evaluation, generation) go to transformers' SDPA unchanged.
    A sliding-window layer (transformers passes `sliding_window`: Mistral, Gemma-3's local layers, Qwen2 with
    `use_sliding_window`) keeps its window inside each example: a token sees the `sliding_window - 1` tokens before
    it, as transformers' `sliding_window_overlay` and flash-attention's `window_size` have it.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    # A vision tower's attention comes here too, without our lengths: transformers 5.23 does not hand the language
    # model's keyword arguments to the tower (tests/equivalence/test_packed_vision.py fails the day it does).
    if cu is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    batch, heads, length, dim = query.shape
    if key.shape[1] != heads:
        key, value = repeat_kv(key, heads // key.shape[1]), repeat_kv(value, heads // value.shape[1])
    dropout_p = dropout if module.training else 0.0
    sizes = getattr(cu, EXAMPLE_SIZES, None) or (cu[1:] - cu[:-1]).tolist()
    longest = max(sizes)
    window = kwargs.get("sliding_window")
    windowed = window is not None and longest > window  # some example is longer than the window
    varlen = query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and dropout_p == 0.0 and _cuda_varlen()
    if varlen and not windowed:
        q, k, v = (t.transpose(1, 2).reshape(batch * length, heads, -1) for t in (query, key, value))
        out = _cuda_varlen()(q, k, v, cu, cu, longest, longest, scaling)
        return out.reshape(batch, length, heads, -1), None
    q, k, v = (t.transpose(0, 1).reshape(heads, batch * length, -1)[None] for t in (query, key, value))
    # `split`, not one slice per example: the backward of a slice writes its gradient into a zero tensor of the
    # whole input, so n slices cost n full-size fills and adds (10% of a training step here); split's is one cat.
    # On a CPU attend in float32 under bf16/fp16: PyTorch's CPU flash-attention backward is ~3x slower in bf16
    # than in fp32 at these sizes (measured on a Zen 4 CPU with avx512_bf16), while the matmuls gain 2x from bf16.
    dtype = q.dtype
    compute = torch.float32 if q.device.type == "cpu" else dtype
    with torch.autocast(q.device.type, enabled=False):
        parts = [
            F.scaled_dot_product_attention(
                qi.to(compute), ki.to(compute), vi.to(compute), scale=scaling, dropout_p=dropout_p,
                **({"attn_mask": _causal_band(n, window, q.device)} if windowed and n > window else {"is_causal": True}),
            )
            for n, qi, ki, vi in zip(sizes, q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2))
        ]  # fmt: skip
    out = torch.cat(parts, dim=2)[0].to(dtype).reshape(heads, batch, length, -1)
    return out.permute(1, 2, 0, 3).contiguous(), None


def _causal_band(length: int, window: int, device) -> torch.Tensor:
    """Causal attention within a sliding window: query i sees keys i - window + 1 .. i."""
    i = torch.arange(length, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < window)


def _text_config(config):
    """The language model's part of a (multimodal) config; the config itself otherwise."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def sliding_window(config) -> int | None:
    """The attention window of a model whose layers (some or all) use one, else None."""
    config = _text_config(config)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None  # Qwen2/Qwen3 carry a window that only `use_sliding_window: true` turns on
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return int(window)


# Layer kinds in a config's `layer_types` that carry state along the row (state-space, convolution, linear or compressed
# attention): no attention mask reaches them, so in a packed row they run from one example into the next.
_RECURRENT_KINDS = ("linear", "mamba", "conv", "ssm", "recurrent", "rwkv", "lstm", "delta", "compress")
# Families whose forward derives biases or masks from a 2D padding mask, so a packed row's 4D mask makes it crash
# (found by sweeping transformers' causal LMs; tests/equivalence/test_packed_attention.py keeps one of each).
_TWO_D_MASK_ONLY = {
    "bloom": "builds its ALiBi biases from a 2D padding mask",
    "openai-gpt": "takes only a 2D attention mask",
}


# The vision-language families whose packed rows train exactly as their examples alone
# (tests/equivalence/test_packed_vision.py), and how their positions restart per example: LLaVA's language model
# takes 1-D positions; Qwen2-VL's and Qwen2.5-VL's take 3-D multimodal rotary positions (time, height, width),
# computed per example by the model's own `get_rope_index`. Other families are refused (`check_packable`): Gemma 3
# lets an image's tokens attend to each other both ways, Idefics3/SmolVLM and the rest are untested here.
PACKABLE_VISION_FAMILIES = {"llava": "1-D", "qwen2_vl": "3-D", "qwen2_5_vl": "3-D"}


def packing_refusal(family: str) -> str:
    """The one line that refuses packing for a vision-language family it does not keep exact."""
    return (f"packing: true with a {family} vision-language model: packing rows with images is supported for "
            f"{', '.join(PACKABLE_VISION_FAMILIES)} only; set packing: false (group_by_length: true batches "
            "examples of similar length, image tokens counted)")  # fmt: skip


def check_packable(model, fix: str = "set packing: false") -> None:
    """Stop with one line where no packed-attention path keeps `model`'s examples apart: layers with state along the
    row (Mamba, convolution, linear attention: Jamba, Bamba, Falcon-H1, Granite-4.0-H, LFM2, Qwen3-Next, ...), and
    families that accept only a 2D mask (Bloom, Falcon with ALiBi, GPT-1). Padded batches train them correctly."""
    family = getattr(model.config, "model_type", "")
    if getattr(model.config, "vision_config", None) is not None and family not in PACKABLE_VISION_FAMILIES:
        raise ConfigError(packing_refusal(family))
    config = _text_config(model.config)
    name, model_type = type(model).__name__, getattr(config, "model_type", "")
    kinds = sorted({str(k) for k in getattr(config, "layer_types", None) or []
                    if "attention" not in str(k) or any(r in str(k) for r in _RECURRENT_KINDS)})  # fmt: skip
    if kinds or compat.has_recurrent_cache(model):  # transformers' flag for a cache with recurrent state
        kinds = "/".join(kinds) or "a recurrent cache"
        raise ConfigError(f"packing: {name} has recurrent layers ({kinds}: state-space, convolution or linear "
                          "attention), which run across the whole packed row, so each example would see the ones "
                          f"packed before it; {fix}")  # fmt: skip
    reason = _TWO_D_MASK_ONLY.get(model_type)
    if model_type == "falcon" and getattr(config, "alibi", False):
        reason = "builds its ALiBi biases from a 2D padding mask"
    if reason:
        raise ConfigError(f"packing: {name} {reason}, so it cannot be given the packed rows' per-example mask; {fix}")


@functools.cache
def _cuda_varlen():
    """PyTorch's flash varlen attention as `f(q, k, v, cu_q, cu_k, max_q, max_k, scale)`, causal; None if absent.

    `torch.nn.attention.varlen.varlen_attn` appeared in PyTorch 2.9 with `is_causal`, later versions take
    `window_size=(-1, 0)` for causal attention instead.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    causal = (
        {"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters else {"is_causal": True}
    )

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, **causal)

    return attend


def use_packed_attention(
    model, device: torch.device | str, max_length: int | None = None, fix: str = "set packing: false"
) -> str:
    """Pick the attention implementation for packed training and switch `model` to it; returns its name.

    `sdpa` becomes `segment_sdpa_attention` (no FLOPs spent across examples) on a CPU, and on any device for a
    model with sliding-window layers whose window is shorter than `max_length` (the longest example; None: not
    known), which the one block-diagonal mask of the other paths would drop. Otherwise the model keeps its backend
    and `attention_inputs` supplies what isolates the examples for it (a block-diagonal mask for sdpa and eager).
    Models no path keeps apart stop with one line (`check_packable`) that ends with `fix`, what to do instead.
    """
    check_packable(model, fix)
    attn = compat.attn_implementation(model.config)
    text_config = _text_config(model.config)
    chunk = getattr(text_config, "attention_chunk_size", None)
    if chunk and "chunked_attention" in (getattr(text_config, "layer_types", None) or []):
        if max_length is None or max_length > chunk:  # transformers chunks by row index, not by example
            raise ConfigError(f"packing: {type(model).__name__} has chunked attention (chunks of {chunk} tokens), "
                              f"which packed rows cannot keep per example; set max_seq_length <= {chunk}, or "
                              f"{fix.removeprefix('set ')}")  # fmt: skip
    window = sliding_window(model.config)
    # One block-diagonal mask (or BlockMask) serves every layer, so it cannot also be each layer's window.
    windowed = window is not None and (max_length is None or max_length > window)
    if windowed and attn in ("eager", "flex_attention"):
        raise ConfigError(f"packing with attn_implementation {attn}: {type(model).__name__} has sliding-window "
                          f"attention (window {window} < max_seq_length {max_length}), which the packed mask cannot "
                          f"keep; use attn_implementation sdpa or flash_attention_2, or {fix.removeprefix('set ')}")  # fmt: skip
    # On CUDA the mask path stays: with PyTorch 2.11 on an H200, the flash varlen kernel made training of a 135M
    # model 5.6x slower than SDPA with the block-diagonal mask (17k vs 97k tokens/s, benchmarks/gpu_engines.py),
    # though its results were right (tests/equivalence/test_packed_attention.py); `segment_sdpa_attention` keeps
    # that path for sliding-window models, and for models switched to it by hand.
    # A model whose attention does not go through transformers' AttentionInterface (Falcon) cannot be switched: it
    # keeps its own SDPA, which the block-diagonal mask keeps exact, and only a window would be lost.
    switchable = compat.can_set_attn_implementation(model)
    if attn == "sdpa" and (torch.device(device).type == "cpu" or windowed) and switchable:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(SEGMENT_SDPA, segment_sdpa_attention)
        AttentionMaskInterface.register(SEGMENT_SDPA, sdpa_mask)  # padded batches and generation get SDPA's masks
        model.set_attn_implementation(SEGMENT_SDPA)
        attn = compat.attn_implementation(model.config)
    if windowed and attn == "sdpa":
        raise ConfigError(f"packing: {type(model).__name__} has sliding-window attention (window {window} < "
                          f"max_seq_length {max_length}) in its own attention code, which packing cannot give a "
                          f"window per example; set max_seq_length <= {window}, or {fix.removeprefix('set ')}")  # fmt: skip
    check_flex_attention(model, device)
    packing_mechanism(attn)  # a clear error now for a backend packing cannot isolate
    return attn


def packing_mechanism(attn_implementation: str) -> str:
    """How `attention_inputs` keeps packed examples apart for this backend (for the log)."""
    if attn_implementation in VARLEN_BACKENDS:
        return "varlen kernel: position ids restarting per example, no attention mask"
    if attn_implementation == SEGMENT_SDPA:
        return (
            "causal attention per example over cumulative lengths (PyTorch's flash varlen kernel on CUDA in bf16, "
            "one SDPA call per example otherwise) + position ids restarting per example"
        )
    if attn_implementation == "sdpa":
        return "explicit block-diagonal causal 4D boolean mask + position ids restarting per example"
    if attn_implementation == "flex_attention":
        return (
            "FlexAttention with a document-causal block mask (blocks across examples skipped) + restarting positions"
        )
    if attn_implementation == "eager":
        return "explicit block-diagonal causal 4D additive float mask + position ids restarting per example"
    raise ConfigError(
        f"packing does not know how to isolate examples with attn_implementation={attn_implementation!r}; "
        "use sdpa, eager, flex_attention or flash_attention_2"
    )


def document_kv_blocks(seq_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Which of FlexAttention's 128 x 128 tiles a document-causal mask touches, read off the examples' boundaries.

    `create_block_mask` evaluates the rule on every `length x length` pair (134M per batch of 8 rows of 4096) and then
    sums tiles; the tiles follow from the segment ids at the tiles' edges, since the ids of a packed row never
    decrease: below the diagonal, tile (q, kv) holds an allowed pair when the kv tile's last id is the q tile's first,
    and all its pairs are allowed when the kv tile's first id is the q tile's last (and the q tile lies inside the
    row); diagonal tiles are always partial. That is O(tiles^2) per row, cheap enough for the collator's worker.
    Returns the tensors `BlockMask.from_kv_blocks` takes (the same values as `create_block_mask`'s), one head.
    """
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE as block

    batch, length = seq_ids.shape
    tiles = -(-length // block)
    edges = F.pad(seq_ids, (0, tiles * block - length), value=-1).view(batch, tiles, block)
    first, last = edges[..., 0], edges[..., -1].clone()
    last[:, -1] = seq_ids[:, -1]  # the last tile's last token inside the row
    below = torch.ones(tiles, tiles, dtype=torch.bool, device=seq_ids.device).tril(-1)
    q_inside = torch.full((tiles, 1), True, device=seq_ids.device)
    q_inside[-1] = length % block == 0
    touched = (below & (last[:, None, :] == first[:, :, None])) | torch.eye(
        tiles, dtype=torch.bool, device=seq_ids.device
    )
    full = below & q_inside & (first[:, None, :] == last[:, :, None])

    def ordered(tiles_used: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        used = tiles_used[:, None].to(torch.int32)  # (batch, head, q tile, kv tile)
        return used.sum(-1, dtype=torch.int32), used.argsort(dim=-1, descending=True, stable=True).to(torch.int32)

    (kv_num_blocks, kv_indices), (full_kv_num_blocks, full_kv_indices) = ordered(touched & ~full), ordered(full)
    return {
        "kv_num_blocks": kv_num_blocks,
        "kv_indices": kv_indices,
        "full_kv_num_blocks": full_kv_num_blocks,
        "full_kv_indices": full_kv_indices,
    }


def document_block_mask(seq_ids: torch.Tensor, kv_blocks: dict[str, torch.Tensor] | None = None):
    """FlexAttention's BlockMask for packed rows: a token sees the earlier tokens of its own example only.

    The dense mask costs `length x length` per row in memory and, in SDPA, computes every score before masking it;
    a BlockMask records which 128 x 128 tiles hold any allowed pair, and the kernel skips the rest (on a row of
    examples averaging a few hundred tokens most tiles of a 4096 row), evaluating the rule only on partial tiles.
    `kv_blocks` are the tiles as `PackedCollator` computed them in the loader's worker (`document_kv_blocks`).
    """
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE as block
    from torch.nn.attention.flex_attention import BlockMask

    length = seq_ids.shape[1]
    # The rule is also evaluated on the tiles' padding past `length`: give those positions an id of their own.
    padded = F.pad(seq_ids, (0, -length % block), value=-1)

    def document_causal(b, h, q, kv):
        return (padded[b, q] == padded[b, kv]) & (q >= kv)

    blocks = kv_blocks if kv_blocks is not None else document_kv_blocks(seq_ids)
    return BlockMask.from_kv_blocks(**blocks, BLOCK_SIZE=block, mask_mod=document_causal, seq_lengths=(length, length))


# What a vision-language batch (`tunebook.data.vision_collate`) gives the model beside its tokens: the image
# processor's outputs (Qwen-VL's patch grid, LLaVA-NeXT's sizes, Idefics' pixel mask) and Qwen-VL's token types.
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask", "mm_token_type_ids")


def image_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The model's image keyword arguments in `batch` (`IMAGE_INPUTS`); none for a text batch."""
    return {key: batch[key] for key in IMAGE_INPUTS if key in batch}


def attention_inputs(batch: dict[str, torch.Tensor], attn_implementation: str, dtype: torch.dtype) -> dict[str, Any]:
    """The keyword arguments for `model(...)`: input ids plus whatever keeps attention where it belongs.

    Padded (unpacked) batches get their 2D `attention_mask` (a vision-language batch its `image_inputs` too). Packed
    batches (with `seq_ids`) get restarting
    `position_ids` and, per backend: nothing more for flash varlen kernels (transformers derives the boundaries
    from the position ids), cumulative lengths for our CPU varlen attention, or an explicit
    4D block-diagonal causal mask built on the device from the small segment ids. We build the mask ourselves
    rather than rely on transformers deriving one from the position ids: it does so only when no 2D mask and no
    KV cache are passed, and silently lets packed examples attend to each other otherwise (evaluation with the
    default `use_cache=True`, for instance).
    """
    if "seq_ids" not in batch:
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
        return {**inputs, **image_inputs(batch)}
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    inputs.update(image_inputs(batch))  # packed rows with images: their images in the rows' order
    if "rope_position_ids" in batch:  # Qwen-VL: its 3-D positions per example, after the 1-D ones that restart
        # at each example and mark the boundaries for flash varlen kernels: (4, batch, length), as the model takes
        inputs["position_ids"] = torch.cat([batch["position_ids"][None], batch["rope_position_ids"].transpose(0, 1)])
    if attn_implementation in VARLEN_BACKENDS:  # transformers derives the cumulative lengths from position ids
        return inputs
    seq = batch["seq_ids"]
    if attn_implementation == SEGMENT_SDPA:
        # Example boundaries over the flattened batch: where the segment id changes, and at every row start.
        flat = (seq + torch.arange(seq.shape[0], device=seq.device)[:, None] * (seq.max() + 1)).flatten()
        starts = torch.nonzero(flat[1:] != flat[:-1]).flatten() + 1
        cu = torch.cat([starts.new_zeros(1), starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
        # The number of examples changes from batch to batch: compiled blocks take it as a dynamic size from the
        # start instead of recompiling for the second batch. The example sizes ride on `cu` itself, read once per
        # batch (on CUDA a host sync) rather than in every layer; as int arguments the longest would be a constant
        # of the graph, recompiled for each new value.
        compat.mark_dynamic(cu, 0)
        setattr(cu, EXAMPLE_SIZES, (cu[1:] - cu[:-1]).tolist())
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        return inputs
    length = seq.shape[1]
    if attn_implementation == "flex_attention":
        # The tiles come from the collator's worker when it knew the backend (`PackedCollator(attn_implementation=)`).
        given = BLOCK_MASK_PREFIX + "kv_indices" in batch
        blocks = {k: batch[BLOCK_MASK_PREFIX + k] for k in BLOCK_MASK_KEYS} if given else None
        inputs["attention_mask"] = document_block_mask(seq, blocks)
        return inputs
    causal = torch.ones(length, length, dtype=torch.bool, device=seq.device).tril()
    allowed = (seq[:, :, None] == seq[:, None, :]) & causal  # (batch, query, key)
    if attn_implementation == "sdpa":
        inputs["attention_mask"] = allowed[:, None]
    elif attn_implementation == "eager":
        mask = torch.zeros(allowed.shape, dtype=dtype, device=seq.device)
        inputs["attention_mask"] = mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
    else:
        packing_mechanism(attn_implementation)  # raises with the list of supported backends
    return inputs
