"""What one micro-batch of each recipe runs through the model, from its config alone: rows, length, the loss
positions, a reference model (DPO, GRPO; distillation's teacher), a generation phase (GRPO, distillation)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Generation", "Workload", "workload"]

REFERENCE_FREE = ("simpo", "orpo")  # DPO losses that load no reference (tunebook.preference.losses)


@dataclass(frozen=True)
class Generation:
    """GRPO's sampling: `rows` completions of up to `tokens` tokens (prompt + completion) at once, through
    `engine` (transformers, vllm_colocate, vllm_server)."""

    rows: int
    tokens: int
    engine: str
    memory_share: float = 0.0  # vLLM colocated: its gpu_memory_utilization
    sleeps: bool = False  # vLLM colocated with sleep mode: its memory is freed while the trainer steps


@dataclass(frozen=True)
class Workload:
    task: str  # causal_lm, classify, reward
    rows: int  # sequences in one micro-batch's forward
    length: int  # their padded length, the longest a config allows
    loss_positions: int  # positions whose logits the loss needs (causal LMs): an upper bound
    padded: bool  # a padding mask is passed to attention (not packed rows)
    reference: bool  # a separate frozen reference model is in memory
    generation: Generation | None = None
    labels: int = 2  # a classifier's outputs
    reference_forward: bool = False  # a reference forward per micro-batch (a separate model or adapters off)
    # More forwards without gradients per micro-batch, each as many rows as the micro-batch (KTO: the policy's and
    # the reference's of the KL rows), in units of the micro-batch's forward.
    extra_forwards: int = 0
    reference_scale: float = 1.0  # the reference's forward FLOPs over the trained model's (distillation's teacher)


def workload(recipe: str, config) -> Workload:
    """The micro-batch `recipe` trains on with `config`, at its largest (every row as long as the config allows)."""
    batch, length = config.per_device_train_batch_size, config.max_seq_length
    if recipe == "classify":
        labels = len(config.label_names) if config.label_names else 2
        return Workload("classify", batch, length, 0, True, False, labels=labels)
    if recipe == "reward":  # chosen and rejected rows in one forward
        return Workload("reward", 2 * batch, length, 0, True, False, labels=1)
    if recipe == "dpo":  # chosen and rejected rows in one forward; the reference is a copy unless LoRA or cached
        forward = not (config.precompute_ref_log_probs or config.loss_type in REFERENCE_FREE)
        return Workload("causal_lm", 2 * batch, length, 2 * batch * length, True, forward and not config.use_peft,
                        reference_forward=forward)  # fmt: skip
    if recipe == "kto":  # its rows with gradients; then without, the KL rows (policy, reference) and the reference's
        forward = not config.precompute_ref_log_probs
        return Workload("causal_lm", batch, length, batch * length, True, forward and not config.use_peft,
                        reference_forward=forward, extra_forwards=2 if forward else 1)  # fmt: skip
    if recipe == "grpo":
        rows, tokens = batch * config.num_generations, config.max_prompt_length + config.max_new_tokens
        if config.use_vllm:
            engine = f"vllm_{config.vllm_mode}"
        else:
            engine = "transformers"
        generation = Generation(rows, tokens, engine, config.vllm_gpu_memory_utilization,
                                config.vllm_enable_sleep_mode)  # fmt: skip
        reference = config.beta > 0 and not config.use_peft
        return Workload("causal_lm", rows, tokens, rows * config.max_new_tokens, True, reference, generation,
                        reference_forward=config.beta > 0)  # fmt: skip
    if recipe == "distill":  # the teacher: a frozen model in memory and its forward per micro-batch (its size:
        # memory.plan); the student samples (lmbda) or the teacher (seq_kd) with transformers
        sampled = config.lmbda > 0 or config.seq_kd
        generation = Generation(batch, length, "transformers") if sampled else None
        return Workload("causal_lm", batch, length, batch * length, True, True, generation, reference_forward=True)
    packed = bool(getattr(config, "packing", recipe == "pretrain"))
    return Workload("causal_lm", batch, length, batch * length, not packed, False)
