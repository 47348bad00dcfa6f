"""Group Relative Policy Optimization (Shao et al., 2024) and its fixes: rollouts, advantages, the clipped loss.

For a prompt, G completions o_1..o_G are sampled and scored (rewards r_i); the advantage of every token of o_i is
r_i minus the group's mean reward, divided by the group's standard deviation (`scale_rewards: group`), the
generation batch's (`batch`) or nothing (`none`, Dr. GRPO's recommendation). With the per-token ratio
rho = pi(o_t) / pi_old(o_t), where pi is the tempered distribution softmax(logits / T) at the sampling temperature T
that the completions were drawn from (as in TRL), the loss of a token is

    -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A)  [+ beta KL_t, k3 estimator vs. the reference]

and the step's loss is its mean under `loss_type`: `grpo` averages each completion's tokens, then the
completions; `dapo` averages all tokens of the step; `dr_grpo` divides the token sum by completions x
max_new_tokens, a constant. The denominators count the whole optimizer step (every micro-batch and process), so
accumulating micro-batches or adding processes gives the gradient of one big batch (as SFT's token mean).

Completions are sampled by greedy decoding of the logits plus Gumbel noise drawn from a generator seeded per
completion (seed, step, prompt row, index in its group): the Gumbel-max trick samples exactly from the
(temperature-scaled, top-p-filtered) distribution, and a completion is the same whatever else shares its batch
or process, so 2 processes sample what 1 does and a resumed run samples what the uninterrupted one did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from ..data.collate import PadCollator, left_padded, loss_positions
from ..data.tokenize import IGNORE_INDEX
from ..evaluation.generate import stop_token_ids as stop_tokens  # recipes' name for the one stop-token rule
from ..training.compilation import eager
from ..training.loss import causal_lm_token_losses

__all__ = [
    "Rollouts",
    "completion_log_probs",
    "group_advantages",
    "grpo_token_losses",
    "loss_normaliser",
    "sample_completions",
    "sample_with_log_probs",
    "step_normaliser",
    "stop_tokens",
]


class SeededSampling(LogitsProcessor):
    """Temperature, top-p, then Gumbel noise from each row's own generator: greedy decoding then samples.

    With `record_log_probs`, it also keeps each sampled token's log-probability under softmax(logits / T) (before
    top-p, as the trainer computes it): a call's distribution is gathered at the next call, once the token chosen
    from it is the last of `input_ids`, so only one (rows, vocabulary) row of log-probs is held at a time."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float, record_log_probs: bool = False):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature, self.top_p = temperature, top_p
        self.record = record_log_probs
        self.log_probs: list[torch.Tensor] = []  # (rows,) per generated position
        self._last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.float() / self.temperature
        if self.record:
            self.take_chosen(input_ids[:, -1])
            self._last = scores.log_softmax(dim=-1)
        if self.top_p < 1.0:
            ordered, order = scores.sort(dim=-1, descending=True)
            probs = ordered.softmax(dim=-1)
            drop = probs.cumsum(dim=-1) - probs >= self.top_p  # keep the smallest set reaching top_p
            scores = scores.masked_fill(drop.scatter(-1, order, drop), -math.inf)
        uniform = torch.stack(
            [torch.rand(scores.shape[-1], generator=g, dtype=torch.float64) for g in self.generators]
        )
        gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-300)))
        return scores + gumbel.to(scores.device, torch.float32)

    def take_chosen(self, chosen: torch.Tensor) -> None:
        """The previous call's log-prob of `chosen` (the token sampled from it); after generation, the last one's."""
        if self._last is not None:
            self.log_probs.append(self._last.gather(1, chosen[:, None].to(self._last.device))[:, 0].cpu())
            self._last = None


def completion_seed(seed: int, step: int, row: int, index: int) -> int:
    """One completion's sampling seed, from what identifies it (not from where it runs)."""
    return (((seed * 1_000_003 + step) * 1_000_033 + row) * 4099 + index) % (2**63 - 1)


@dataclass
class Rollouts:
    """The completions of one micro-batch of prompts, ready for the loss: right-padded prompt + completion rows."""

    input_ids: torch.Tensor  # (n, length)
    attention_mask: torch.Tensor
    labels: torch.Tensor  # completion tokens (up to and including EOS); IGNORE_INDEX elsewhere
    completion_lengths: torch.Tensor  # (n,) tokens of each completion
    advantages: torch.Tensor  # (n,)
    old_log_probs: torch.Tensor | None  # per loss token (flat, in loss-position order); None: the policy's own
    ref_log_probs: torch.Tensor | None  # per loss token, with beta > 0
    # A vision-language model's image inputs for these rows (`PromptImages.inputs`): a group's rows share its images
    image_inputs: dict[str, torch.Tensor] | None = None
    # The sampler's log-probs of the loss tokens (flat, like old_log_probs), where it reports them
    sampler_log_probs: torch.Tensor | None = None
    # The importance weights of the loss tokens (`tunebook.rl.mismatch`): set at the first update, kept for the rest
    importance_weights: torch.Tensor | None = None

    def batch(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "labels": self.labels,
                **loss_positions(self.labels)}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        state = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        if self.image_inputs is not None:  # each tensor with its dtype (pixels float, grids and types integer)
            state["image_inputs"] = {k: [str(v.dtype).removeprefix("torch."), v.tolist()]
                                     for k, v in self.image_inputs.items()}  # fmt: skip
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], device) -> Rollouts:
        dtypes = {"input_ids": torch.long, "attention_mask": torch.long, "labels": torch.long,
                  "completion_lengths": torch.long}  # fmt: skip
        state = dict(state)
        images = state.pop("image_inputs", None)
        rollouts = cls(**{k: None if v is None else torch.tensor(v, dtype=dtypes.get(k, torch.float32), device=device)
                          for k, v in state.items()})  # fmt: skip
        if images is not None:
            rollouts.image_inputs = {k: torch.tensor(v, dtype=getattr(torch, dtype), device=device)
                                     for k, (dtype, v) in images.items()}  # fmt: skip
        return rollouts


@torch.no_grad()
def sample_completions(model, prompt_ids: list[list[int]], seeds: list[int], *, pad_token_id: int,
                       eos_token_id: int | list[int], max_new_tokens: int, temperature: float, top_p: float,
                       device, greedy: bool = False, images=None) -> list[list[int]]:  # fmt: skip
    """The completion ids of the prompts (one per seed; repeat a prompt for several), each up to and including its
    first EOS token. `greedy` decodes without noise (evaluation). `images`: a vision-language model's prompts'
    images (`tunebook.rl.vision_prompts.PromptImages`, row for row), never generated as image tokens."""
    return sample_with_log_probs(model, prompt_ids, seeds, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                                 max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, device=device,
                                 greedy=greedy, images=images, record=False)[0]  # fmt: skip


@torch.no_grad()
def sample_with_log_probs(model, prompt_ids: list[list[int]], seeds: list[int], *, pad_token_id: int,
                          eos_token_id: int | list[int], max_new_tokens: int, temperature: float, top_p: float,
                          device, greedy: bool = False, images=None,
                          record: bool = True) -> tuple[list[list[int]], list[list[float]] | None]:  # fmt: skip
    """`sample_completions`, and (with `record`, not greedy) each completion token's log-probability under the
    sampling model's softmax(logits / temperature): what a generation backend reports next to its tokens."""
    input_ids, attention_mask = left_padded(prompt_ids, pad_token_id)  # every completion starts at one position
    longest = input_ids.shape[1]
    was_training = model.training
    model.eval()
    sampler = None if greedy else SeededSampling(seeds, temperature, top_p, record_log_probs=record)
    sampling = {} if sampler is None else {"logits_processor": LogitsProcessorList([sampler])}
    input_ids = input_ids.to(device)
    if images is not None:  # suppressed before the sampling noise: an image token's score is -inf
        sampling.update(images.inputs(input_ids), suppress_tokens=images.suppressed_tokens())
    with eager():  # under torch_compile: decoding with a KV cache would compile graphs of its own
        out = model.generate(
            input_ids=input_ids, attention_mask=attention_mask.to(device), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=pad_token_id, eos_token_id=eos_token_id, **sampling,
            temperature=None, top_p=None, top_k=None,
        )  # fmt: skip
    model.train(was_training)
    stops = set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
    completions = []
    for row in out[:, longest:].tolist():
        end = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
        completions.append(row[:end])
    if sampler is None or not record:
        return completions, None
    sampler.take_chosen(out[:, -1])
    table = torch.stack(sampler.log_probs, dim=1).tolist() if sampler.log_probs else [[] for _ in completions]
    return completions, [row[: len(c)] for row, c in zip(table, completions)]


def rollout_rows(prompt_ids: list[list[int]], completions: list[list[int]], pad_token_id: int, device,
                 loss_mask: list[list[int]] | None = None):  # fmt: skip
    """Right-padded prompt + completion rows (`PadCollator`): input_ids, attention_mask, labels on the completion
    tokens, and the completions' lengths in trained tokens. `loss_mask` (multi-turn episodes, `tunebook.rl.episodes`):
    per completion token, 1 where the model generated it, 0 where the environment wrote it (no label, not counted),
    so every loss_type normalises over the model's own tokens."""
    masks = loss_mask or [[1] * len(c) for c in completions]
    features = [{"input_ids": p + c, "labels": [IGNORE_INDEX] * len(p) + [t if m else IGNORE_INDEX for t, m in zip(c, mask)]}
                for p, c, mask in zip(prompt_ids, completions, masks)]  # fmt: skip
    batch = PadCollator(pad_token_id)(features)
    lengths = torch.tensor([sum(mask) for mask in masks], dtype=torch.long)
    return tuple(t.to(device) for t in (batch["input_ids"], batch["attention_mask"], batch["labels"], lengths))


def completion_log_probs(model, rollouts: Rollouts, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of every completion token, flat in loss-position order, float32, with gradients if on;
    the row, i.e. completion, of each) under `log_softmax(logits / temperature)`.

    Pass the sampling temperature, for the policy, the old policy and the reference alike: the completions were
    drawn from the tempered distribution, so the ratio, its clipping and the KL refer to it, and at the first
    update the ratio is that of the policy that sampled (on-policy). TRL does the same: v1.9.0,
    trl/trainer/grpo_trainer.py, `_get_per_token_logps_and_entropies` lines 1517-1519 (`logits.div_(
    self.temperature)` before `selective_log_softmax`), called for the old policy (line 2565), the reference (lines
    2628, 2644) and the policy in the loss (line 3001). Top-p is not applied here, as there: it only truncates.
    """
    batch = rollouts.batch()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False,
              **(rollouts.image_inputs or {})}  # fmt: skip
    losses, positions = causal_lm_token_losses(model, inputs, batch, temperature)
    return -losses, positions // batch["labels"].shape[1]


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str, batch_std: torch.Tensor | None = None):
    """(advantages, groups whose rewards are all equal): rewards (n,) in groups of `group_size` consecutive
    completions; `batch_std` is the whole generation batch's reward std (all processes) for `scale='batch'`."""
    grouped = rewards.view(-1, group_size)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
    std = grouped.std(dim=1) if group_size > 1 else torch.zeros(grouped.shape[0], device=rewards.device)
    if scale == "group":
        centred = centred / (std.repeat_interleave(group_size) + 1e-4)
    elif scale == "batch":
        centred = centred / (batch_std + 1e-4)
    return centred, (std < 1e-6)


def grpo_token_losses(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                      epsilon: float, epsilon_high: float, beta: float = 0.0,
                      ref_log_probs: torch.Tensor | None = None,
                      importance_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-token losses (the clipped surrogate, times the importance weights where the sampler was not the trained
    module (`tunebook.rl.mismatch`), plus beta x KL), whether each token was clipped, and the per-token KL (zeros
    without a reference). `advantages` is per token (each completion's, repeated over its tokens)."""
    ratio = torch.exp(log_probs - old_log_probs)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    losses = -surrogate if importance_weights is None else -surrogate * importance_weights
    clipped = ((ratio < 1 - epsilon) & (advantages < 0)) | ((ratio > 1 + epsilon_high) & (advantages > 0))
    kl = torch.zeros_like(losses)
    if beta > 0 and ref_log_probs is not None:
        delta = ref_log_probs - log_probs
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, always >= 0
        losses = losses + beta * kl
    return losses, clipped.detach(), kl.detach()


def loss_numerator(token_losses: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, loss_type: str):
    """What a micro-batch adds to the step's loss before the step-wide division (`loss_normaliser`)."""
    if loss_type == "grpo":  # each completion's token mean, summed over completions
        return (token_losses / lengths[rows].clamp(min=1).to(token_losses.dtype)).sum()
    return token_losses.sum()  # dapo and dr_grpo: the token sum


def loss_normaliser(loss_type: str, completions: torch.Tensor, tokens: torch.Tensor, max_new_tokens: int):
    """The step-wide denominator: completions (grpo), completion tokens (dapo) or completions x max_new_tokens
    (dr_grpo), counted over every micro-batch and process of the step."""
    if loss_type == "grpo":
        return completions
    if loss_type == "dapo":
        return tokens
    return completions * max_new_tokens


def step_normaliser(rollouts: list[Rollouts], loss_type: str, max_new_tokens: int, accelerator):
    """(`loss_normaliser` of the step's rollouts on every process, the step's completion tokens): one all-reduce."""
    device = rollouts[0].completion_lengths.device
    local = torch.zeros(2, device=device)
    for r in rollouts:
        local += torch.stack(
            [torch.tensor(float(len(r.completion_lengths)), device=device), r.completion_lengths.sum().float()]
        )
    completions, tokens = accelerator.reduce(local, "sum")
    return loss_normaliser(loss_type, completions, tokens, max_new_tokens), tokens
