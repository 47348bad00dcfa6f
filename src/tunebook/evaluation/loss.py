"""Token-weighted evaluation loss, exact on any number of processes."""

from __future__ import annotations

import numpy as np
import torch
from accelerate import Accelerator

from ..models.attention import attention_inputs
from ..training.loss import causal_lm_token_losses
from .batches import gathered_batches
from .scores import perplexity

__all__ = ["evaluate_loss"]


@torch.no_grad()
def evaluate_loss(
    model: torch.nn.Module,
    loader,
    accelerator: Accelerator,
    attn_implementation: str = "sdpa",
    disable_tqdm: bool = True,
) -> dict:
    """Mean next-token loss over all loss-bearing tokens of the eval set, and its perplexity.

    Works on padded and on packed batches (`attention_inputs` keeps packed examples apart). Per-row sums and
    counts are gathered (`gathered_batches`), so the result does not depend on the number of processes.
    """
    dtype = next(model.parameters()).dtype

    def row_sums(batch):
        losses, positions = causal_lm_token_losses(model, attention_inputs(batch, attn_implementation, dtype), batch)
        # Per-row sums, so gather_for_metrics can drop the rows Accelerate duplicated.
        rows = positions // batch["labels"].shape[1]
        loss_sums = torch.zeros(len(batch["labels"]), dtype=torch.float32, device=losses.device).index_add_(
            0, rows, losses
        )
        return loss_sums, torch.bincount(rows, minlength=len(batch["labels"]))

    loss_sums_seen, counts_seen = [], []
    for loss_sums, counts in gathered_batches(model, loader, accelerator, row_sums, disable_tqdm=disable_tqdm):
        loss_sums_seen.append(loss_sums.double().cpu().numpy())
        counts_seen.append(counts.cpu().numpy())
    # Token-weighted: the sum of every token's loss over the number of tokens, then exp of that.
    result = perplexity(np.concatenate(loss_sums_seen), np.concatenate(counts_seen))
    total_tokens = int(np.concatenate(counts_seen).sum())
    return {"eval_loss": result["loss"], "eval_perplexity": result["perplexity"], "eval_tokens": total_tokens}
