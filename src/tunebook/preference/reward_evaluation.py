"""Reward model evaluation: Bradley-Terry loss, rewards and pairwise accuracy on held-out pairs, exact on any number
of processes."""

from __future__ import annotations

import torch

from ..run.logging import progress_bar
from .losses import RewardStats
from .reward import REWARD_FIGURES, bradley_terry_loss, pair_rewards

__all__ = ["evaluate_reward_model"]


@torch.no_grad()
def evaluate_reward_model(model, loader, accelerator, disable_tqdm: bool = True) -> dict[str, float]:
    """`eval_loss`, `eval_rewards/chosen`, `eval_rewards/rejected`, `eval_accuracy` (the share of pairs whose chosen
    response gets the higher reward) and `eval_margin` (chosen minus rejected reward), means over all pairs.

    Per-pair values go through `gather_for_metrics`, which drops the duplicates Accelerate adds to even out the
    last batch, so the result equals a single-process evaluation.
    """
    was_training = model.training
    model.eval()
    stats = RewardStats("cpu", REWARD_FIGURES)
    for batch in progress_bar(accelerator.is_main_process, disable_tqdm, iterable=loader, desc="Evaluating",
                              leave=False):  # fmt: skip
        losses, chosen, rejected = bradley_terry_loss(pair_rewards(model, batch), batch.get("margin"))
        stats.add(*(t.cpu() for t in accelerator.gather_for_metrics((losses, chosen, rejected))))  # all pairs once
    model.train(was_training)
    return {**stats.means("eval_"), "eval_pairs": int(stats.sums[0].item())}
