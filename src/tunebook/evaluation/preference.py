"""DPO evaluation: loss, implicit rewards and reward accuracy on held-out pairs, exact on any number of processes."""

from __future__ import annotations

import torch

from ..logging import progress_bar
from ..training.preference import RewardStats, dpo_loss, policy_and_reference_log_probs

__all__ = ["evaluate_preferences"]


@torch.no_grad()
def evaluate_preferences(
    model, reference, loader, accelerator, attn: str, dtype, beta: float, label_smoothing: float = 0.0,
    disable_tqdm: bool = True,
) -> dict[str, float]:  # fmt: skip
    """`eval_loss`, `eval_rewards/chosen`, `eval_rewards/rejected`, `eval_rewards/accuracy` (the share of pairs
    whose chosen response gets the higher implicit reward) and `eval_rewards/margin`, means over all pairs.

    Per-pair values go through `gather_for_metrics`, which drops the duplicates Accelerate adds to even out the
    last batch, so the result equals a single-process evaluation.
    """
    was_training = model.training
    model.eval()
    stats = RewardStats("cpu")
    for batch in progress_bar(accelerator.is_main_process, disable_tqdm, iterable=loader, desc="Evaluating",
                              leave=False):  # fmt: skip
        policy, ref = policy_and_reference_log_probs(model, reference, batch, attn, dtype, accelerator)
        half = policy.shape[0] // 2
        losses, chosen, rejected = dpo_loss(
            policy[:half], policy[half:], ref[:half], ref[half:], beta, label_smoothing
        )
        stats.add(*(t.cpu() for t in accelerator.gather_for_metrics((losses, chosen, rejected))))  # all pairs once
    model.train(was_training)
    return {**stats.means("eval_"), "eval_pairs": int(stats.sums[0].item())}
