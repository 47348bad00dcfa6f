"""Direct Preference Optimization (Rafailov et al., 2023) and its variants: sequence log-probabilities, the losses,
reward statistics, and the reference model's log-probabilities (live, from adapters switched off, or precomputed and
cached).

With pi and ref the summed log-probabilities of a response under the policy and the reference model, the
implicit rewards are r = beta (pi - ref), and the sigmoid loss of a pair is
    -(1 - eps) log sigmoid(r_chosen - r_rejected) - eps log sigmoid(r_rejected - r_chosen)
(eps = label_smoothing, the conservative variant as in TRL <= 0.19, whose sigmoid loss in 1.16 ignores it; eps = 0
is plain DPO). `preference_loss` holds the other loss types, with TRL's formulas; its docstring gives each, and
where the NLL terms (rpo_alpha, orpo) differ from TRL's.
"""

from __future__ import annotations

import math
from pathlib import Path

import datasets
import torch
import torch.nn.functional as F

from ..data.tokenize import IGNORE_INDEX
from ..models.attention import attention_inputs
from ..models.wrappers import unwrap
from ..training.loss import causal_lm_token_losses

__all__ = [
    "LOSS_TYPES",
    "REFERENCE_FREE_LOSSES",
    "RewardStats",
    "dpo_loss",
    "policy_and_reference_log_probs",
    "precompute_reference_log_probs",
    "preference_loss",
    "reference_log_probs",
    "response_lengths",
    "sequence_log_probs",
    "weights_fingerprint",
]

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
REFERENCE_FREE_LOSSES = ("simpo", "orpo")  # measured against no reference model: none is built or run


def sequence_log_probs(model, batch: dict[str, torch.Tensor], attn: str = "sdpa", dtype=torch.float32) -> torch.Tensor:
    """Summed log-probability of each row's labelled tokens (the response), float32, shape (rows,).

    Logits are computed only at labelled positions (`causal_lm_token_losses`), so the prompt costs no LM head.
    """
    losses, positions = causal_lm_token_losses(model, attention_inputs(batch, attn, dtype), batch)
    rows = positions // batch["labels"].shape[1]
    return -torch.zeros(batch["labels"].shape[0], dtype=losses.dtype, device=losses.device).index_add(0, rows, losses)


def response_lengths(labels: torch.Tensor) -> torch.Tensor:
    """Tokens whose log-probabilities `sequence_log_probs` sums, per row (position 0 is never predicted)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair sigmoid DPO losses and the (detached) implicit rewards of the chosen and rejected responses."""
    policy, reference = torch.cat([policy_chosen, policy_rejected]), torch.cat([reference_chosen, reference_rejected])
    lengths = torch.ones_like(policy, dtype=torch.long)  # the sigmoid loss uses none
    return preference_loss(policy, reference, lengths, "sigmoid", beta, label_smoothing)


def preference_loss(
    policy: torch.Tensor,
    reference: torch.Tensor | None,
    lengths: torch.Tensor,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    rpo_alpha: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and the (detached) rewards of the chosen and rejected responses, with TRL's formulas but for
    sigmoid's label_smoothing (cDPO, as TRL <= 0.19) and the NLL terms (below).

    `policy`, `reference` and `lengths` hold 2B rows, chosen then rejected: summed log-probabilities
    (`sequence_log_probs`) and response tokens (`response_lengths`). With d = (pi_c - ref_c) - (pi_r - ref_r),
    the log-ratio difference, and eps = label_smoothing:

    - sigmoid: -(1 - eps) log s(beta d) - eps log s(-beta d)                               (DPO; cDPO with eps)
    - ipo:     (d' - 1 / (2 beta))^2, d' as d with each log-ratio divided by its response's tokens: TRL's choice,
               confirmed with the IPO authors, so that beta means the same at any response length
    - hinge:   max(0, 1 - beta d)                                                             (SLiC)
    - robust:  (-(1 - eps) log s(beta d) + eps log s(-beta d)) / (1 - 2 eps)   (rDPO, unbiased under label noise)
    - simpo:   -log s(beta (a_c - a_r) - simpo_gamma), a = pi / tokens, the mean log-probability per token; no
               reference (TRL's CPOTrainer)
    - orpo:    -a_c - beta log s(log odds(a_c) - log odds(a_r)), odds(a) = e^a / (1 - e^a); no reference.
               -a_c is the chosen response's NLL per token; TRL's ORPOTrainer takes the token mean over the whole
               batch of the prompt and response tokens instead, which weights long sequences more and is not a
               per-pair loss.

    rpo_alpha adds rpo_alpha x the chosen response's NLL per token (-a_c) to any loss but orpo (RPO): a mean per
    pair, where TRL's (rpo_alpha up to 0.19, the sft loss type in 1.16) is one token mean over the batch. Rewards are beta x the log-ratio with a reference and beta x a without (as TRL logs
    them), so rewards/accuracy is the share of pairs the model already orders right by the loss's own measure.
    """
    half = policy.shape[0] // 2
    tokens = lengths.clamp(min=1).to(policy.dtype)
    if loss_type in REFERENCE_FREE_LOSSES:
        chosen, rejected = (policy / tokens)[:half], (policy / tokens)[half:]
        if loss_type == "simpo":
            losses = -F.logsigmoid(beta * (chosen - rejected) - simpo_gamma)
        elif loss_type == "orpo":
            log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
            losses = -chosen - beta * F.logsigmoid(log_odds)
        else:
            raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
        chosen_rewards, rejected_rewards = beta * chosen, beta * rejected
    else:
        ratios = policy - reference
        chosen_rewards, rejected_rewards = beta * ratios[:half], beta * ratios[half:]
        margin = chosen_rewards - rejected_rewards  # beta d
        eps = label_smoothing
        if loss_type == "sigmoid":
            losses = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
        elif loss_type == "ipo":
            per_token = ratios / tokens
            losses = (per_token[:half] - per_token[half:] - 1 / (2 * beta)) ** 2
        elif loss_type == "hinge":
            losses = torch.relu(1 - margin)
        elif loss_type == "robust":
            losses = (-(1 - eps) * F.logsigmoid(margin) + eps * F.logsigmoid(-margin)) / (1 - 2 * eps)
        else:
            raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
    if rpo_alpha is not None:
        losses = losses + rpo_alpha * -(policy[:half] / tokens[:half])
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, accurate on both sides of -log 2 (Maechler, 2012); each branch gets only inputs it
    handles, so the one torch.where discards cannot put a NaN in the gradient."""
    cut = -math.log(2)
    return torch.where(x < cut, torch.log1p(-torch.exp(x.clamp(max=cut))), torch.log(-torch.expm1(x.clamp(min=cut))))


def policy_and_reference_log_probs(
    model, reference, batch: dict[str, torch.Tensor], attn: str, dtype, accelerator, use_reference: bool = True
):
    """(policy log-probs with gradients, reference log-probs without), each of shape (2B,): chosen, then rejected.

    The reference is, in this order of preference: the batch's precomputed `ref_*_logps`; the policy with its
    LoRA adapters switched off (`reference` is None and the model has adapters); or the frozen `reference` model.
    With `use_reference` false (a reference-free loss) it is None, and no reference forward runs.
    """
    policy = sequence_log_probs(model, batch, attn, dtype)
    if not use_reference:
        return policy, None
    if "ref_chosen_logps" in batch:
        return policy, torch.cat([batch["ref_chosen_logps"], batch["ref_rejected_logps"]])
    return policy, reference_log_probs(model, reference, batch, attn, dtype, accelerator)


def reference_log_probs(model, reference, batch: dict[str, torch.Tensor], attn: str, dtype, accelerator):
    """The reference's summed log-probabilities of each row's response, without gradients: the frozen `reference`
    model, or with `reference` None the policy `model` with its LoRA adapters switched off."""
    with torch.no_grad(), accelerator.autocast():
        if reference is None:
            with unwrap(model).disable_adapter():
                return sequence_log_probs(model, batch, attn, dtype)
        return sequence_log_probs(reference, batch, attn, dtype)


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

    def local_loss(self) -> float | None:
        """This process's mean loss of the window so far, without ending it (the timed progress line)."""
        pairs, loss = self.sums[:2].tolist()
        return loss / pairs if pairs else None

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
    reference, dataset: datasets.Dataset, collate, device, cache_dir: Path, key: str, batch_size: int, attn: str,
    columns: tuple[str, str] = ("ref_chosen_logps", "ref_rejected_logps"),
) -> datasets.Dataset:  # fmt: skip
    """`dataset` with `ref_chosen_logps`/`ref_rejected_logps` columns from `reference`, cached under `key` (a
    fingerprint of the data and the reference weights): a second run with the same data and model skips it.
    `collate` makes 2B rows of B examples, the first half's log-probabilities go to `columns[0]`, the second's to
    `columns[1]` (KTO: each row, then its KL row). Returns (dataset, was_cached)."""
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
        table = datasets.Dataset.from_dict({columns[0]: chosen, columns[1]: rejected})
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
