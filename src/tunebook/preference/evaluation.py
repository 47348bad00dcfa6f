"""DPO evaluation: loss, implicit rewards and reward accuracy on held-out pairs, exact on any number of processes."""

from __future__ import annotations

import torch

from ..evaluation.batches import gathered_batches
from .losses import (
    REFERENCE_FREE_LOSSES,
    RewardStats,
    policy_and_reference_log_probs,
    preference_loss,
    response_lengths,
)

__all__ = ["evaluate_preferences"]


@torch.no_grad()
def evaluate_preferences(
    model, reference, loader, accelerator, attn: str, dtype, beta: float, label_smoothing: float = 0.0,
    disable_tqdm: bool = True, *, loss_type: str = "sigmoid", simpo_gamma: float = 0.5, rpo_alpha: float | None = None,
) -> dict[str, float]:  # fmt: skip
    """`eval_loss`, `eval_rewards/chosen`, `eval_rewards/rejected`, `eval_rewards/accuracy` (the share of pairs
    whose chosen response gets the higher implicit reward) and `eval_rewards/margin`, means over all pairs.

    Per-pair values are gathered (`gathered_batches`), so the result equals a single-process evaluation. The loss and rewards are `preference_loss`'s for
    `loss_type` (the one training uses); a reference-free loss runs no reference.
    """
    use_reference = loss_type not in REFERENCE_FREE_LOSSES

    def per_pair(batch):
        policy, ref = policy_and_reference_log_probs(model, reference, batch, attn, dtype, accelerator, use_reference)
        losses, chosen, rejected = preference_loss(
            policy, ref, response_lengths(batch["labels"]), loss_type, beta, label_smoothing, simpo_gamma, rpo_alpha
        )
        return losses, chosen, rejected

    stats = RewardStats("cpu")
    for losses, chosen, rejected in gathered_batches(model, loader, accelerator, per_pair, disable_tqdm=disable_tqdm):
        stats.add(losses.cpu(), chosen.cpu(), rejected.cpu())
    return {**stats.means("eval_"), "eval_pairs": int(stats.sums[0].item())}
