"""A run's peak memory per device, part by part, and its speed: `plan(recipe, config, layout, hardware)`.

States (weights, gradients, AdamW's two moments) are counted from the model's parameters and the engine's
sharding; what a micro-batch's forward and backward create (activations, the loss's logits, the backward's
temporaries, the gradients as they appear) is not estimated from a formula but traced: the real model's step runs
on fake tensors (`trace.trace_step`), so any architecture, LoRA, gradient checkpointing and the fused loss come out
as they run. What the trace cannot see is added from the engine: FSDP2's gathered layers, DDP's gradient buckets,
a reference model, a generation's cache, and the CUDA context with the caching allocator's slack.
"""

from __future__ import annotations

from dataclasses import asdict, astuple, dataclass, field, replace

import torch

from .. import compat
from .architecture import build_architecture, model_config_of, teacher_parameters
from .flops import model_flops_per_token
from .hardware import GiB, Hardware
from .layout import Layout
from .trace import Phase, StepTrace, trace_step
from .workloads import Workload, workload

__all__ = ["PARTS", "Plan", "plan"]

PARTS = ("weights", "gradients", "optimizer", "activations", "logits", "reference", "generation", "overhead")

# Outside the allocator's count, measured on H100s with torch 2.x: the CUDA context, cuBLAS' workspaces and the
# kernels' images (~0.5 GiB); NCCL's buffers under several processes (~0.25 GiB). The caching allocator rounds and
# keeps freed blocks: reserved runs ~5% above allocated at a training peak. Refined by the GPU rows of
# benchmarks/RESULTS.md.
CUDA_CONTEXT = 0.5 * GiB
NCCL_BUFFERS = 0.25 * GiB
ALLOCATOR_SLACK = 0.05
DEFAULT_MFU = 0.4  # a well-fed dense bf16 step on an H100 reaches 40-50% (benchmarks/RESULTS.md, vs_peers)


@dataclass
class Plan:
    """Bytes per device by part (`PARTS`), their `total` against `device_memory`, and the speed."""

    recipe: str
    hardware: str
    engine: str
    processes: int
    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    reference: float = 0.0
    generation: float = 0.0
    overhead: float = 0.0
    total: float = 0.0
    allocated: float = 0.0  # total less what the allocator does not count: compare with max_memory_allocated
    device_memory: float = 0.0
    fits: bool = False
    micro_batch: dict = field(default_factory=dict)
    params: int = 0
    trainable: int = 0
    flops_per_token: float = 0.0
    tokens_per_step: int = 0
    mfu: float = DEFAULT_MFU
    tokens_per_second: float | None = None
    seconds_per_step: float | None = None
    steps: int | None = None
    seconds_total: float | None = None
    recommendation: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def plan(recipe: str, config, layout: Layout, hardware: Hardware, architecture=None, mfu: float = DEFAULT_MFU,
         model_config=None, on_gpu: bool = True, teacher_architecture=None) -> Plan:  # fmt: skip
    """The plan of `recipe` run with `config` over `layout` on `hardware`. `model_config` (a transformers config)
    saves reading it again; `on_gpu` False leaves out the CUDA-only overhead (a plan checked on a CPU);
    `teacher_architecture` the config.json of a distillation run's teacher (else read as the run reads it)."""
    import copy

    work = workload(recipe, config)
    model_config = copy.deepcopy(model_config or model_config_of(config, architecture))
    mixed = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(layout.mixed_precision)
    sharded_compute = mixed if layout.sharded else None
    if layout.activation_checkpointing and not config.gradient_checkpointing:
        config = copy.copy(config)
        config.gradient_checkpointing = True  # FSDP's own checkpointing: the same recompute
    depth = _depth(model_config)
    arch = build_architecture(config, model_config, work.task, sharded_compute, layout.sharded, work.labels,
                              traced=depth is None)  # fmt: skip
    result = Plan(recipe, hardware.name, layout.engine, layout.processes, device_memory=hardware.memory,
                  params=arch.params, trainable=arch.trainable, mfu=mfu)  # fmt: skip
    result.micro_batch = {"rows": work.rows, "length": work.length,
                          "gradient_accumulation_steps": config.gradient_accumulation_steps}  # fmt: skip
    accumulate = config.gradient_accumulation_steps > 1

    def traced(architecture) -> StepTrace:
        with compat.fake_tensor_mode():
            if accumulate and not layout.sharded:  # the gradients of the earlier micro-batches are there already
                for p in architecture.model.parameters():
                    if p.requires_grad:
                        p.grad = torch.zeros_like(p)
            return trace_step(architecture.model, _micro_batch(architecture, work, config, on_gpu),
                              keep_grads=not layout.sharded, autocast=None if layout.sharded else mixed)  # fmt: skip

    if depth is None:
        step = traced(arch)
    else:  # one and two repeating units of layers, extrapolated to all of them: the same bytes in seconds
        holder, layers, unit = depth
        shallow = []
        for n in (unit, 2 * unit):
            reduced = copy.deepcopy(model_config)
            _set_depth(reduced, n)
            shallow.append(traced(build_architecture(config, reduced, work.task, sharded_compute, layout.sharded,
                                                     work.labels)))  # fmt: skip
        step = _extrapolated(*shallow, layers / unit - 2)
    _states(result, arch, layout, config, step, accumulate)
    masked = (
        work.task == "causal_lm" and (config.attn_implementation or "sdpa") not in VARLEN and (work.padded or on_gpu)
    )
    result.activations = step.top.activations + (_padding_masks(work, arch) if masked else 0)
    result.logits = step.top.logits
    result.reference = arch.weight_bytes / (layout.shard_over if layout.sharded else 1) if work.reference else 0
    if recipe == "distill":  # the teacher: its own size, in the dtype it runs in, and its forward's FLOPs
        teacher_bytes, scale = _teacher(result, arch, config, on_gpu, teacher_architecture)
        work = replace(work, reference_scale=scale)
        result.reference = teacher_bytes / (layout.shard_over if layout.sharded else 1)
    result.generation = _generation(work, arch, hardware)
    # The peak is the larger of the step's (its activations, logits and the gradients made so far) and the
    # generation's (GRPO: the engine's cache, no activations), over what stays: weights, optimizer, reference, and
    # the gradients where they outlive a micro-batch (accumulation, the sharded engines' shards).
    keeps_grads = accumulate or layout.sharded
    buckets = arch.trainable_bytes if layout.engine == "ddp" else 0  # allocated with DDP, for good
    grads = result.gradients - buckets
    stepping = result.activations + result.logits + (0 if keeps_grads else step.top.grads)
    base = result.weights + result.optimizer + result.reference + buckets + (grads if keeps_grads else 0)
    generation = work.generation
    if generation is not None and generation.engine == "vllm_colocate" and not generation.sleeps:
        base += result.generation  # the engine keeps its share while the trainer steps
        transient = stepping
    else:
        transient = max(stepping, result.generation)
    if not keeps_grads:  # the optimizer step: every gradient at once, the step's activations gone
        transient = max(transient, grads)
    result.allocated = base + transient
    result.overhead = (CUDA_CONTEXT + (NCCL_BUFFERS if layout.processes > 1 else 0) + ALLOCATOR_SLACK *
                       result.allocated) if on_gpu else 0.0  # fmt: skip
    result.total = result.allocated + result.overhead
    result.fits = result.total <= hardware.memory
    _speed(result, arch, work, config, layout, hardware)
    return result


def _teacher(result: Plan, arch, config, on_gpu: bool, architecture) -> tuple[float, float]:
    """A distillation teacher's weight bytes, its parameters (`teacher_parameters`) in the dtype it runs in
    (`distillation.teacher.teacher_dtype`: bfloat16 on a GPU under `auto`, else the student's), and its size over
    the student's (its forward's FLOPs); the student's when its config.json cannot be read (said in the notes)."""
    count, why = teacher_parameters(config, architecture)
    if count is None:
        result.notes.append(why)
        return arch.weight_bytes, 1.0
    named = {"float32": 4, "bfloat16": 2, "float16": 2}
    per_weight = named.get(config.teacher_dtype) or (2 if on_gpu else arch.weight_bytes / max(arch.params, 1))
    return count * per_weight, count / max(arch.params, 1)


def _depth(model_config) -> tuple[object, int, int] | None:
    """(the config holding the layer count, the layers, the layers of one repeating unit), where tracing two
    units and extrapolating saves time: every layer of a unit keeps the same bytes per layer as the next unit's
    (sliding-window and global layers alike, with an efficient attention kernel). None: trace the whole model."""
    holder = getattr(model_config, "text_config", None) or model_config
    layers = getattr(holder, "num_hidden_layers", None)
    if not isinstance(layers, int):
        return None
    kinds = getattr(holder, "layer_types", None) or [None] * layers
    unit = next(p for p in range(1, layers + 1) if all(kinds[i] == kinds[i % p] for i in range(layers)))
    return (holder, layers, unit) if layers > 3 * unit else None


def _extrapolated(one: StepTrace, two: StepTrace, more: float) -> StepTrace:
    """Each phase of the two-unit trace, `more` units further along the line through the one- and two-unit traces:
    phase by phase, as their peaks grow at different rates (the forward's end gains a layer's cast weights per layer
    under autocast with checkpointing, the backward does not), and the larger may change with depth."""

    def phase(a: Phase, b: Phase) -> Phase:
        return Phase(*(y + more * (y - x) for x, y in zip(astuple(a), astuple(b))))

    return StepTrace(phase(one.forward, two.forward), phase(one.backward, two.backward),
                     two.grads + more * (two.grads - one.grads))  # fmt: skip


def _set_depth(model_config, layers: int) -> None:
    holder = getattr(model_config, "text_config", None) or model_config
    holder.num_hidden_layers = layers
    if getattr(holder, "layer_types", None):
        holder.layer_types = holder.layer_types[:layers]


def _micro_batch(arch, work: Workload, config, on_gpu: bool):
    """The forward of one micro-batch and its loss, as the recipe computes it (the fused linear cross-entropy of
    `training.loss` where the head allows, else logits and cross-entropy), over fake token ids, with the attention
    the run would use (`_attention`)."""
    import torch.nn.functional as F

    from ..models.linear_ce import linear_cross_entropy

    model = arch.model
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    extra = _attention(inner, work, config, on_gpu) if work.task == "causal_lm" else {}

    def run(meter) -> torch.Tensor:
        ids = torch.zeros(work.rows, work.length, dtype=torch.long)
        if work.task != "causal_lm":
            logits = model(input_ids=ids).logits.float()
            return logits.sum()
        hidden = inner.base_model(input_ids=ids, **extra()).last_hidden_state
        positions = torch.arange(work.loss_positions)
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        # The loss's logits: from here until the backward reaches the head's input.
        meter.kind = "logits"
        rows.register_hook(lambda grad: setattr(meter, "kind", "other"))
        targets = torch.zeros(work.loss_positions, dtype=torch.long)
        head = inner.get_output_embeddings()
        if type(head) is torch.nn.Linear:
            return linear_cross_entropy(rows, head.weight, head.bias, targets).sum()
        return F.cross_entropy(head(rows).float(), targets, reduction="sum")

    return run


VARLEN = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn", "kernels-community/flash-attn3")
PLANNED_SDPA = "tunebook_planned_sdpa"


def _attention(inner, work: Workload, config, on_gpu: bool):
    """Set the attention the run's rows get and return what else its forward takes (a callable: the fake tensors
    are made inside the trace). Padded rows, and packed ones on a GPU (their block-diagonal mask, `models.attention`),
    get SDPA with a mask: keys and values repeated to every query head (`_padding_masks` adds the mask). Packed rows
    on a CPU get `segment_sdpa_attention`, as they do in a run there (per example, in float32). Flash varlen
    kernels take grouped keys as they are; eager keeps its scores."""
    from ..models.attention import EXAMPLE_SIZES, SEGMENT_SDPA, segment_sdpa_attention

    attention = config.attn_implementation or "sdpa"
    if attention == "eager" or attention in VARLEN:
        return dict
    from transformers import AttentionInterface

    if not work.padded and not on_gpu:
        AttentionInterface.register(SEGMENT_SDPA, segment_sdpa_attention)
        inner.set_attn_implementation(SEGMENT_SDPA)

        def packed():
            cu = torch.arange(0, work.rows * work.length + 1, work.length, dtype=torch.int32)
            setattr(cu, EXAMPLE_SIZES, [work.length] * work.rows)  # one example per row: the same bytes as several
            return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}

        return packed
    AttentionInterface.register(PLANNED_SDPA, _masked_sdpa)
    inner.set_attn_implementation(PLANNED_SDPA)
    return dict


def _masked_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What transformers' SDPA attention keeps for the backward when a mask is passed: keys and values repeated to
    every query head, the kernel's output and log-sum-exp (the mask itself is `_padding_masks`': the trace runs
    without one, as transformers' mask building reads the data)."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import repeat_kv

    if key.shape[1] != query.shape[1]:
        key, value = repeat_kv(key, query.shape[1] // key.shape[1]), repeat_kv(value, query.shape[1] // value.shape[1])
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _states(result: Plan, arch, layout: Layout, config, step, accumulate: bool) -> None:
    """Weights, gradients and AdamW's moments per device, by engine (ZeRO paper's accounting for DeepSpeed, with
    bf16 weights and float32 master weights, gradients and moments)."""
    trainable, shards = arch.trainable, layout.shard_over
    stored = 2 if config.dtype in ("bfloat16", "float16") else 4  # a trained weight's bytes as the recipe keeps it
    frozen = arch.weight_bytes - arch.trainable * (arch.trainable_bytes / max(arch.trainable, 1))
    compute = 2 if layout.mixed_precision in ("bf16", "fp16") else stored
    if layout.engine in ("single", "ddp"):
        result.weights = arch.weight_bytes
        result.gradients = arch.trainable_bytes  # in the parameters' dtype
        if layout.engine == "ddp":
            result.gradients += arch.trainable_bytes  # DDP's buckets: a flat copy of the gradients to all-reduce
        result.optimizer = 2 * arch.trainable_bytes
    elif layout.engine == "fsdp2":
        gathered = (2 if layout.reshard_after_forward else arch.blocks) * arch.largest_block * compute
        sharded = (frozen + trainable * stored) / shards
        result.weights = (0 if layout.offload_params else sharded) + min(gathered, arch.params * compute)
        result.gradients = 0 if layout.offload_params else trainable * stored / shards
        result.optimizer = 0 if layout.offload_optimizer else 2 * trainable * stored / shards
    else:  # DeepSpeed: 16-bit weights, float32 gradient partition, float32 master weights and two moments
        if layout.engine == "zero3":
            live = min(arch.params, 2 * arch.largest_block) * 2  # the layers gathered around the one computing
            result.weights = (0 if layout.offload_params else arch.params * 2 / shards) + live
        else:
            result.weights = arch.params * 2
        result.gradients = trainable * 4 / shards
        result.optimizer = 0 if layout.offload_optimizer else 12 * trainable / shards


def _padding_masks(work: Workload, arch) -> int:
    """A padded batch's attention mask as SDPA gets it (rows x length x length, boolean, and the additive one in
    the compute dtype), which the fake trace runs without (its shape-only `all()` checks cannot run on fake data)."""
    element = next(p for p in arch.model.parameters()).element_size()
    return work.rows * work.length * work.length * (1 + element)


def _generation(work: Workload, arch, hardware: Hardware) -> float:
    """GRPO's sampling memory: transformers' key/value cache of every completion of a micro-batch at full length,
    and its last position's float32 logits, twice (sampling's softmax); vLLM colocated takes its
    `gpu_memory_utilization` share of the device; a vLLM server runs on other GPUs."""
    generation = work.generation
    if generation is None or generation.engine == "vllm_server":
        return 0.0
    if generation.engine == "vllm_colocate":
        return generation.memory_share * hardware.memory
    return generation.rows * (generation.tokens * arch.kv_bytes_per_token + 2 * arch.vocab * 4)


def _speed(result: Plan, arch, work: Workload, config, layout: Layout, hardware: Hardware) -> None:
    """FLOPs per token (`flops.model_flops_per_token`: 6 x linear MACs + attention), tokens per step over all
    devices, and at the stated MFU the tokens per second and the run's duration where its steps are known."""
    head_fraction = work.loss_positions / max(work.rows * work.length, 1) if work.task == "causal_lm" else 0.0
    result.flops_per_token = model_flops_per_token(arch.model, work.length, head_fraction=head_fraction)
    result.tokens_per_step = work.rows * work.length * config.gradient_accumulation_steps * layout.processes
    if hardware.peak_flops:
        # What the hardware computes per token, in units of 2 x parameters (a forward): the forward, the backward's
        # input gradients, its weight gradients for the trained weights only (LoRA: the adapters'), a forward again
        # under checkpointing, the reference's forward (DPO, GRPO with beta) and any other forward without gradients
        # (KTO's of the KL rows). Model FLOPs count 3 units.
        trained = arch.trainable / max(arch.params, 1)
        units = 1 + 1 + trained + (1 if config.gradient_checkpointing or layout.activation_checkpointing else 0)
        units += (work.reference_scale if work.reference_forward else 0) + work.extra_forwards
        result.tokens_per_second = hardware.peak_flops * layout.processes * result.mfu / result.flops_per_token
        result.tokens_per_second *= 3 / units
        result.seconds_per_step = result.tokens_per_step / result.tokens_per_second
        if config.max_steps and config.max_steps > 0:
            result.steps = config.max_steps
            result.seconds_total = result.steps * result.seconds_per_step
    if work.generation is not None:
        result.notes.append("the time leaves out sampling, which is decode-bound: see benchmarks/RESULTS.md")
