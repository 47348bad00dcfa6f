"""DPO evaluation: loss, implicit rewards and reward accuracy on held-out pairs, exact on any number of processes."""

from __future__ import annotations

import torch

from ..logging import progress_bar
from ..training.preference import dpo_loss, policy_and_reference_log_probs

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
    sums = torch.zeros(5, dtype=torch.float64)
    for batch in progress_bar(accelerator.is_main_process, disable_tqdm, iterable=loader, desc="Evaluating",
                              leave=False):  # fmt: skip
        policy, ref = policy_and_reference_log_probs(model, reference, batch, attn, dtype, accelerator)
        half = policy.shape[0] // 2
        losses, chosen, rejected = dpo_loss(
            policy[:half], policy[half:], ref[:half], ref[half:], beta, label_smoothing
        )
        losses, chosen, rejected = accelerator.gather_for_metrics((losses, chosen, rejected))
        sums += torch.stack([torch.tensor(float(len(losses))), losses.sum().cpu(), chosen.sum().cpu(),
                             rejected.sum().cpu(), (chosen > rejected).sum().cpu()]).double()  # fmt: skip
    model.train(was_training)
    pairs, loss, chosen, rejected, correct = sums.tolist()
    n = max(pairs, 1.0)
    return {
        "eval_loss": loss / n,
        "eval_rewards/chosen": chosen / n,
        "eval_rewards/rejected": rejected / n,
        "eval_rewards/accuracy": correct / n,
        "eval_rewards/margin": (chosen - rejected) / n,
        "eval_pairs": int(pairs),
    }
