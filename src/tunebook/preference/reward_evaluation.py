"""Reward model evaluation: Bradley-Terry loss, rewards and pairwise accuracy on held-out pairs, exact on any number
of processes."""

from __future__ import annotations

import torch

from ..evaluation.batches import gathered_batches
from .losses import RewardStats
from .reward import REWARD_FIGURES, bradley_terry_loss, pair_rewards

__all__ = ["evaluate_reward_model"]


@torch.no_grad()
def evaluate_reward_model(model, loader, accelerator, disable_tqdm: bool = True) -> dict[str, float]:
    """`eval_loss`, `eval_rewards/chosen`, `eval_rewards/rejected`, `eval_accuracy` (the share of pairs whose chosen
    response gets the higher reward) and `eval_margin` (chosen minus rejected reward), means over all pairs.

    Per-pair values are gathered (`gathered_batches`), so the result equals a single-process evaluation.
    """

    def per_pair(batch):
        losses, chosen, rejected = bradley_terry_loss(pair_rewards(model, batch), batch.get("margin"))
        return losses, chosen, rejected

    stats = RewardStats("cpu", REWARD_FIGURES)
    for losses, chosen, rejected in gathered_batches(model, loader, accelerator, per_pair, disable_tqdm=disable_tqdm):
        stats.add(losses.cpu(), chosen.cpu(), rejected.cpu())
    return {**stats.means("eval_"), "eval_pairs": int(stats.sums[0].item())}
