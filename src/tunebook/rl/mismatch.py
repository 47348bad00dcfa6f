"""Correcting for completions the trained module did not sample itself (TRL's `vllm_importance_sampling_*`).

vLLM samples with its own kernels and precision, and async generation samples from weights one step behind: the
sampler's distribution pi_s differs from the trainer's pi_theta (at the weights the rollouts are first trained on).
The trainer recomputes the log-probs it trains on; the sampler's are used to weight each token's clipped surrogate
by the importance ratio rho = pi_theta(o_t) / pi_s(o_t) (Yao et al., 2025, "Your efficient RL framework secretly
brings you off-policy RL training"), as TRL does (trl/trainer/grpo_trainer.py, `vllm_importance_sampling_ratio`):

    token_truncate       w_t = clip(rho_t, C_min, C_max)
    token_mask           w_t = rho_t where C_min <= rho_t <= C_max, else 0
    sequence_truncate    w_t = clip(prod_t rho_t, C_min, C_max) for every token of the completion
    sequence_mask        w_t = prod_t rho_t where within [C_min, C_max], else 0

The weights multiply the surrogate only, not the KL penalty, and carry no gradient. An unset bound is no bound.
"""

from __future__ import annotations

import torch

__all__ = ["importance_weights"]


def importance_weights(trainer: torch.Tensor, sampler: torch.Tensor, rows: torch.Tensor, num_rows: int, mode: str,
                       clip_min: float | None, clip_max: float | None) -> torch.Tensor:  # fmt: skip
    """Per-token weights (flat, like `trainer`): `trainer` and `sampler` are the sampled tokens' log-probs, `rows`
    the completion of each token (of `num_rows`)."""
    delta = (trainer.detach() - sampler).float()
    if mode.startswith("sequence"):
        per_row = torch.zeros(num_rows, dtype=delta.dtype, device=delta.device).index_add_(0, rows, delta)
        delta = per_row[rows]
    ratio = torch.exp(delta)
    low = -torch.inf if clip_min is None else clip_min
    high = torch.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        return ratio.clamp(min=low, max=high)
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
