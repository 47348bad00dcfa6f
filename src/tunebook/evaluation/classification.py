"""Classification evaluation, exact on any number of processes, in memory that does not grow with logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from .batches import gathered_batches
from .metrics import load_metrics

__all__ = ["classifier_inputs", "evaluate_classifier"]


def classifier_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's keyword arguments: everything but the labels (the loss is computed by the recipe)."""
    return {k: v for k, v in batch.items() if k != "labels"}


@torch.no_grad()
def evaluate_classifier(
    model: torch.nn.Module,
    loader,
    accelerator: Accelerator,
    metrics: list[str],
    average: str | None = None,
    disable_tqdm: bool = True,
) -> dict[str, float]:
    """Mean cross-entropy (`eval_loss`) and `evaluate` metrics over the whole eval set, prefixed `eval_`.

    Per batch, only predicted class ids, labels and per-example losses are gathered (`gathered_batches`) and added
    to the metrics, so memory stays flat and the result equals a single-process evaluation. Every process computes the same metrics.
    """

    def per_example(batch):
        logits = model(**classifier_inputs(batch)).logits
        losses = F.cross_entropy(logits.float(), batch["labels"], reduction="none")
        return logits.argmax(-1), batch["labels"], losses

    combined = load_metrics(metrics, average)
    total_loss = torch.zeros((), dtype=torch.float64)
    count = 0
    for predictions, labels, losses in gathered_batches(model, loader, accelerator, per_example,
                                                        disable_tqdm=disable_tqdm):  # fmt: skip
        combined.add_batch(predictions=predictions.cpu().numpy(), references=labels.cpu().numpy())
        total_loss += losses.double().sum().cpu()
        count += len(labels)
    results = {"eval_loss": (total_loss / max(count, 1)).item(), "eval_examples": count}
    results.update({f"eval_{k}": float(v) for k, v in combined.compute().items()})
    return results
