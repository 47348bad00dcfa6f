"""Direct Preference Optimization (Rafailov et al., 2023): sequence log-probabilities, the loss, reward statistics,
and the reference model's log-probabilities (live, from adapters switched off, or precomputed and cached).

With pi and ref the summed log-probabilities of a response under the policy and the reference model, the
implicit rewards are r = beta (pi - ref), and the sigmoid loss of a pair is
    -(1 - eps) log sigmoid(r_chosen - r_rejected) - eps log sigmoid(r_rejected - r_chosen)
(eps = label_smoothing, the conservative variant; eps = 0 is plain DPO).
"""

from __future__ import annotations

from pathlib import Path

import datasets
import torch
import torch.nn.functional as F

from ..data.packing import attention_inputs
from .loss import causal_lm_token_losses

__all__ = [
    "RewardStats",
    "dpo_loss",
    "policy_and_reference_log_probs",
    "precompute_reference_log_probs",
    "sequence_log_probs",
    "weights_fingerprint",
]


def sequence_log_probs(model, batch: dict[str, torch.Tensor], attn: str = "sdpa", dtype=torch.float32) -> torch.Tensor:
    """Summed log-probability of each row's labelled tokens (the response), float32, shape (rows,).

    Logits are computed only at labelled positions (`causal_lm_token_losses`), so the prompt costs no LM head.
    """
    losses, positions = causal_lm_token_losses(model, attention_inputs(batch, attn, dtype), batch)
    rows = positions // batch["labels"].shape[1]
    return -torch.zeros(batch["labels"].shape[0], dtype=losses.dtype, device=losses.device).index_add(0, rows, losses)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO losses and the (detached) implicit rewards of the chosen and rejected responses."""
    chosen_rewards = beta * (policy_chosen - reference_chosen)
    rejected_rewards = beta * (policy_rejected - reference_rejected)
    margin = chosen_rewards - rejected_rewards
    losses = -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def policy_and_reference_log_probs(model, reference, batch: dict[str, torch.Tensor], attn: str, dtype, accelerator):
    """(policy log-probs with gradients, reference log-probs without), each of shape (2B,): chosen, then rejected.

    The reference is, in this order of preference: the batch's precomputed `ref_*_logps`; the policy with its
    LoRA adapters switched off (`reference` is None and the model has adapters); or the frozen `reference` model.
    """
    policy = sequence_log_probs(model, batch, attn, dtype)
    if "ref_chosen_logps" in batch:
        return policy, torch.cat([batch["ref_chosen_logps"], batch["ref_rejected_logps"]])
    with torch.no_grad(), accelerator.autocast():
        if reference is None:
            with accelerator.unwrap_model(model).disable_adapter():
                return policy, sequence_log_probs(model, batch, attn, dtype)
        return policy, sequence_log_probs(reference, batch, attn, dtype)


# TRL's DPOTrainer names of the logged means of loss, chosen and rejected rewards, reward accuracy and margin.
DPO_FIGURES = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin")


class RewardStats:
    """Running sums of a logging window (this process): pairs, loss, chosen and rejected rewards, correct orderings.
    `names` are the logged names of the means of loss, chosen and rejected rewards, accuracy and margin: DPO's by
    default (TRL's DPOTrainer names); a reward model logs TRL's RewardTrainer names."""

    def __init__(self, device, names: tuple[str, ...] = DPO_FIGURES):
        self.sums = torch.zeros(5, dtype=torch.float64, device=device)
        self.names = names

    def add(self, losses: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        values = [losses.detach().sum(), chosen.sum(), rejected.sum(), (chosen > rejected).sum()]
        self.sums += torch.stack([torch.tensor(float(len(chosen)), device=chosen.device), *values]).double()

    def pop(self, accelerator, prefix: str = "") -> dict[str, float]:
        """`means` over all processes since the last call; starts a new window."""
        self.sums = accelerator.reduce(self.sums.clone(), "sum")
        means = self.means(prefix) if self.sums[0] > 0 else dict.fromkeys(self.means(prefix))  # none: all skipped
        self.sums.zero_()
        return means

    def state_dict(self) -> dict[str, list[float]]:
        return {"sums": self.sums.tolist()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.sums.copy_(torch.tensor(state["sums"], dtype=torch.float64))

    def means(self, prefix: str = "") -> dict[str, float]:
        """Mean loss, chosen and rejected rewards, accuracy (the share of pairs whose chosen response has the higher
        reward) and margin (chosen minus rejected reward) of the pairs added so far, under `names`."""
        pairs, loss, chosen, rejected, correct = self.sums.tolist()
        n = max(pairs, 1.0)
        values = (loss, chosen, rejected, correct, chosen - rejected)
        return {f"{prefix}{name}": value / n for name, value in zip(self.names, values)}


@torch.no_grad()
def precompute_reference_log_probs(
    reference, dataset: datasets.Dataset, collate, device, cache_dir: Path, key: str, batch_size: int, attn: str
) -> datasets.Dataset:
    """`dataset` with `ref_chosen_logps`/`ref_rejected_logps` columns from `reference`, cached under `key` (a
    fingerprint of the data and the reference weights): a second run with the same data and model skips it.
    Returns (dataset, was_cached)."""
    from ..data.cache import cached_dataset

    def build(scratch):
        was_training = reference.training
        reference.eval()
        chosen, rejected = [], []
        for start in range(0, len(dataset), batch_size):
            rows = dataset.select(range(start, min(start + batch_size, len(dataset))))
            batch = {k: v.to(device) for k, v in collate(list(rows)).items()}
            logps = sequence_log_probs(reference, batch, attn, reference.dtype).cpu()
            half = len(rows)
            chosen += logps[:half].tolist()
            rejected += logps[half:].tolist()
        reference.train(was_training)
        table = datasets.Dataset.from_dict({"ref_chosen_logps": chosen, "ref_rejected_logps": rejected})
        return table, {"pairs": len(dataset)}

    logps, _, cached = cached_dataset(cache_dir, key, build)
    return datasets.concatenate_datasets([dataset, logps], axis=1), cached


def weights_fingerprint(model) -> str:
    """Hash of a model's parameter values: what precomputed reference log-probabilities depend on."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:24]
