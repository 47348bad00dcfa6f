"""Kahneman-Tversky Optimization (Ethayarajh et al., 2024): the loss, the KL reference point, the logged figures and
the evaluation.

With r = pi - ref the log-ratio of a completion (summed log-probabilities under the policy and the reference) and z0
the KL reference point, a desirable row's loss is desirable_weight x (1 - sigmoid(beta (r - z0))) and an
undesirable row's undesirable_weight x (1 - sigmoid(beta (z0 - r))): Eq. (7) of the paper, TRL's `KTOTrainer`. z0
estimates KL(policy || reference) from mismatched rows (a prompt with another row's completion, `kto_data`): the mean
of their log-ratios, clamped at 0, without gradients.

Where this differs from TRL, and why: TRL takes z0 per micro-batch, from mismatched pairs formed inside it, as the
mean over processes of each process's mean, and its loss is the mean over the micro-batch's rows. Here the mismatched
pairs are fixed at data preparation, z0 is the mean over every KL row of the optimizer step (all micro-batches, all
processes; `step_kl_and_reference`), and the loss is the mean over the step's rows: k accumulated micro-batches of b
rows train exactly as one batch of k x b, and 2 processes as their union batch. With one micro-batch on one process
the two agree (tests/unit/preference/test_kto.py compares against TRL's code). Evaluation takes z0 over the whole
eval set, so its figures do not depend on the eval batch size or the number of processes.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import torch

from ..data.collate import PadCollator
from ..evaluation.batches import gathered_batches
from ..training.compilation import eager
from .kto_data import kl_batch
from .losses import precompute_reference_log_probs, reference_log_probs, sequence_log_probs

__all__ = ["KTOStats", "evaluate_kto", "kto_loss", "precompute_kto_reference", "step_kl_and_reference"]


def kto_loss(
    policy: torch.Tensor,
    reference: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor | float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KTO losses (weighted) and the rows' (detached) implicit rewards beta x (pi - ref).

    `policy` and `reference` hold each row's summed log-probabilities, `desirable` its label, `kl` the step's
    reference point z0 (`step_kl_and_reference`), a constant here: no gradient flows through it."""
    ratios = policy - reference
    kl = torch.as_tensor(kl, dtype=ratios.dtype, device=ratios.device)
    desirable_losses = desirable_weight * (1 - torch.sigmoid(beta * (ratios - kl)))
    undesirable_losses = undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratios)))
    return torch.where(desirable.bool(), desirable_losses, undesirable_losses), (beta * ratios).detach()


@torch.no_grad()
def step_kl_and_reference(model, reference, window: list[dict], attn: str, dtype, accelerator):
    """(z0, each micro-batch's reference log-probabilities of its rows) for an optimizer step's `window`.

    z0 is the mean log-ratio of every KL row of the step, over all micro-batches and processes, clamped at 0: the
    policy's forward without gradients (compiled blocks run eagerly: a graph without gradients would be one more
    to compile), the reference's (or the precomputed values). The reference's log-probabilities of the rows
    themselves come from the same pass, so the loss's pass runs the policy only."""
    sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    references = []
    with eager():
        for batch in window:
            rows = kl_batch(batch)
            policy_kl = sequence_log_probs(model, rows, attn, dtype)
            if "ref_logps" in batch:  # precomputed
                reference_kl, reference_rows = batch["ref_kl_logps"], batch["ref_logps"]
            else:
                reference_kl = reference_log_probs(model, reference, rows, attn, dtype, accelerator)
                reference_rows = reference_log_probs(model, reference, batch, attn, dtype, accelerator)
            sums[0] += (policy_kl - reference_kl).double().sum()
            sums[1] += len(policy_kl)
            references.append(reference_rows)
    sums = accelerator.reduce(sums, "sum")
    return (sums[0] / sums[1].clamp(min=1)).clamp(min=0), references


# The logged means, TRL's KTOTrainer names but rewards/margin (DPO's name here): loss, chosen (desirable) and
# rejected (undesirable) rewards, their difference, and z0.
KTO_FIGURES = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "kl")


class KTOStats:
    """Running sums of a logging window (this process): rows, loss, desirable rows and their rewards, undesirable rows
    and theirs, and the steps' z0."""

    def __init__(self, device):
        self.sums = torch.zeros(8, dtype=torch.float64, device=device)

    def add(self, losses: torch.Tensor, rewards: torch.Tensor, desirable: torch.Tensor) -> None:
        desirable = desirable.bool()
        values = [
            torch.tensor(float(len(losses)), device=losses.device), losses.detach().sum(),
            desirable.sum(), rewards[desirable].sum(), (~desirable).sum(), rewards[~desirable].sum(),
        ]  # fmt: skip
        self.sums[:6] += torch.stack([v.to(self.sums) for v in values])

    def add_kl(self, kl: torch.Tensor) -> None:
        """One step's z0 (the same on every process)."""
        self.sums[6:] += torch.stack([kl.to(self.sums), torch.ones((), dtype=self.sums.dtype, device=kl.device)])

    def pop(self, accelerator, prefix: str = "") -> dict[str, float | None]:
        """`means` over all processes since the last call; starts a new window."""
        self.sums = accelerator.reduce(self.sums.clone(), "sum")
        means = self.means(prefix) if self.sums[0] > 0 else dict.fromkeys(self.means(prefix))  # none: all skipped
        self.sums.zero_()
        return means

    def local_loss(self) -> float | None:
        """This process's mean loss of the window so far, without ending it (the timed progress line)."""
        rows, loss = self.sums[:2].tolist()
        return loss / rows if rows else None

    def state_dict(self) -> dict[str, list[float]]:
        return {"sums": self.sums.tolist()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.sums.copy_(torch.tensor(state["sums"], dtype=torch.float64))

    def means(self, prefix: str = "") -> dict[str, float | None]:
        """Mean loss over the rows, mean reward of the desirable and of the undesirable rows (None where there were
        none), their difference, and the mean z0 of the steps, under `KTO_FIGURES`'s names."""
        rows, loss, desirable, chosen, undesirable, rejected, kl, steps = self.sums.tolist()
        chosen = chosen / desirable if desirable else None
        rejected = rejected / undesirable if undesirable else None
        margin = chosen - rejected if chosen is not None and rejected is not None else None
        values = (loss / max(rows, 1.0), chosen, rejected, margin, kl / steps if steps else None)
        return {f"{prefix}{name}": value for name, value in zip(KTO_FIGURES, values)}


@torch.no_grad()
def evaluate_kto(
    model, reference, loader, accelerator, attn: str, dtype, beta: float, desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0, disable_tqdm: bool = True,
) -> dict[str, float]:  # fmt: skip
    """`eval_loss`, `eval_rewards/chosen`, `eval_rewards/rejected`, `eval_rewards/margin` and `eval_kl` over the
    held-out rows, with z0 the mean log-ratio of all their KL rows (clamped at 0).

    Per-row values are gathered (`gathered_batches`), so the result equals a single-process evaluation."""

    def per_row(batch):
        rows = kl_batch(batch)
        policy, policy_kl = sequence_log_probs(model, batch, attn, dtype), sequence_log_probs(model, rows, attn, dtype)
        if "ref_logps" in batch:
            ref, ref_kl = batch["ref_logps"], batch["ref_kl_logps"]
        else:
            ref = reference_log_probs(model, reference, batch, attn, dtype, accelerator)
            ref_kl = reference_log_probs(model, reference, rows, attn, dtype, accelerator)
        return policy, ref, policy_kl - ref_kl, batch["label"].long()  # gloo gathers no booleans

    parts = list(gathered_batches(model, loader, accelerator, per_row, disable_tqdm=disable_tqdm))
    policy, ref, kl_terms, labels = (torch.cat([p[i].cpu().double() for p in parts]) for i in range(4))
    kl = kl_terms.mean().clamp(min=0)
    losses, rewards = kto_loss(policy, ref, labels.bool(), kl, beta, desirable_weight, undesirable_weight)
    stats = KTOStats("cpu")
    stats.add(losses, rewards, labels.bool())
    stats.add_kl(kl)
    return {**stats.means("eval_"), "eval_rows": len(labels)}


def precompute_kto_reference(reference, dataset: datasets.Dataset, pad_token_id: int, device, cache_dir: Path,
                             key: str, batch_size: int, attn: str) -> tuple[datasets.Dataset, bool]:  # fmt: skip
    """`dataset` with `ref_logps` and `ref_kl_logps` (each row's and its KL row's reference log-probabilities),
    cached under `key` (`precompute_reference_log_probs`)."""
    pad = PadCollator(pad_token_id)

    def rows_then_kl_rows(features):
        rows = [{"input_ids": f["input_ids"], "labels": f["labels"]} for f in features]
        return pad(rows + [{"input_ids": f["kl_input_ids"], "labels": f["kl_labels"]} for f in features])

    return precompute_reference_log_probs(reference, dataset, rows_then_kl_rows, device, cache_dir, key, batch_size,
                                          attn, columns=("ref_logps", "ref_kl_logps"))  # fmt: skip
