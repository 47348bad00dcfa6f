"""Where GRPO's completions come from: one interface, a backend per engine.

    backend.generate(prompt_ids, seeds, sampling) -> Generated(token_ids, log_probs)
    backend.push_weights(model)     # after every optimizer step that changed the weights

`prompt_ids` holds one prompt per completion (a group's prompt repeated G times) and `seeds` one seed per
completion (`tunebook.rl.grpo.completion_seed`), so a completion is the same whatever shares its batch, process or
engine, where the engine is deterministic. `log_probs` are the engine's own log-probabilities of the tokens it
sampled, under softmax(logits / temperature): the trainer recomputes the log-probs it trains on, and these measure
(and, with `vllm_importance_sampling_correction`, correct for) how far the engine's distribution is from the
trainer's (`tunebook.rl.mismatch`).

Backends: `transformers` (the policy's own `generate`, the default and what CI runs), `vllm` colocated (an engine
in each training process) and `vllm` server (`tunebook vllm-serve`): `tunebook.rl.vllm_backends`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..models.wrappers import unwrap
from .grpo import sample_with_log_probs

__all__ = ["Generated", "GenerationBackend", "Sampling", "TransformersBackend", "stop_id_tuple"]


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled: the same keys whatever the engine."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0


def stop_id_tuple(ids: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    """`evaluation.generate.stop_token_ids`'s answer (one id, several, or none) as `Sampling.stop_token_ids`."""
    return () if ids is None else (ids,) if isinstance(ids, int) else tuple(ids)


@dataclass
class Generated:
    """Each completion's token ids (up to and including its first stop token) and, where the engine reports them,
    the log-probability it sampled each token with."""

    token_ids: list[list[int]]
    log_probs: list[list[float]] | None = None


class GenerationBackend:
    """What the recipe asks of a generation engine (see the module docstring)."""

    name = "abstract"
    #: True where the trainer's own module samples: its log-probs are the trainer's, no mismatch to correct
    samples_with_trainer = False
    #: True where the engine starts with the policy's weights (no push needed before the first generation)
    starts_from_policy = False

    def generate(self, prompt_ids: list[list[int]], seeds: list[int], sampling: Sampling, images=None) -> Generated:
        raise NotImplementedError

    def push_weights(self, model: torch.nn.Module, accelerator=None) -> None:
        """Make the engine sample from `model`'s current weights."""

    def close(self) -> None:
        """Release the engine (its memory, its process)."""


class TransformersBackend(GenerationBackend):
    """The policy's own `generate` with per-completion seeded sampling (`tunebook.rl.grpo.SeededSampling`).

    `snapshot=True` (async generation) samples from a copy of the policy instead, refreshed by `push_weights`, so
    generation can run in a thread while the policy trains; the copy costs one more model in memory."""

    name = "transformers"
    starts_from_policy = True

    def __init__(self, model: torch.nn.Module, device, snapshot: bool = False):
        self.device = device
        self.samples_with_trainer = not snapshot
        self.model = model
        self.snapshot = None
        if snapshot:
            self.name = "transformers (a copy of the policy)"
            self.snapshot = copy.deepcopy(unwrap(model)).requires_grad_(False).eval()

    def policy(self) -> torch.nn.Module:
        return self.snapshot if self.snapshot is not None else unwrap(self.model)

    def generate(self, prompt_ids, seeds, sampling: Sampling, images=None) -> Generated:
        token_ids, log_probs = sample_with_log_probs(
            self.policy(),
            prompt_ids,
            seeds,
            pad_token_id=sampling.pad_token_id,
            eos_token_id=list(sampling.stop_token_ids),
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            device=self.device,
            images=images,
        )
        return Generated(token_ids, log_probs)

    @torch.no_grad()
    def push_weights(self, model: torch.nn.Module, accelerator=None) -> None:
        if self.snapshot is not None:  # the trainer's own module needs nothing: it is the policy
            self.snapshot.load_state_dict(unwrap(model).state_dict())
