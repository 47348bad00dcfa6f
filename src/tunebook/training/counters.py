"""What a run counts as it trains: tokens and examples seen (for rates and the summary), and the loss of each
logging window. Kept on the device, so the loop never waits for the host between logs, and saved per process in
every checkpoint (each rank its own file), so a resumed run continues every sum exactly."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate import Accelerator

__all__ = ["LossWindow", "TrainCounters"]


@dataclass
class TrainCounters:
    """This process's running totals of the data it trained on."""

    tokens_seen: torch.Tensor  # non-padding input tokens
    fed_tokens: torch.Tensor  # all input tokens, padding included
    samples_seen: torch.Tensor  # examples (a packed row holds several)

    @classmethod
    def zeros(cls, device) -> TrainCounters:
        return cls(*(torch.zeros((), dtype=torch.long, device=device) for _ in range(3)))

    def add_batch(self, batch: dict[str, torch.Tensor]) -> None:
        """Count a micro-batch's tokens (real and fed) and examples, without waiting for the device."""
        mask = batch["attention_mask"]
        self.tokens_seen += mask.sum()
        self.fed_tokens += mask.numel()
        if "seq_ids" in batch:  # packed rows: an example starts wherever a real token's position id is 0
            self.samples_seen += ((batch["position_ids"] == 0) & mask.bool()).sum()
        else:
            self.samples_seen += mask.shape[0]

    def state_dict(self) -> dict[str, int]:
        return {name: getattr(self, name).item() for name in self.__dataclass_fields__}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).fill_(state.get(name, 0))  # checkpoints from before samples_seen existed


class LossWindow:
    """The training loss of a logging window: a sum of losses and of what the loss is a mean over (loss tokens for
    language models, examples for classifiers), added after each successful update, averaged over all processes."""

    def __init__(self, device):
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)

    def add(self, loss_sum: torch.Tensor, count: torch.Tensor | int) -> None:
        self.sums += torch.stack([torch.as_tensor(loss_sum).double(), torch.as_tensor(count).double().to(self.sums)])

    def pop(self, accelerator: Accelerator) -> dict[str, float]:
        """{"loss": mean since the last call, over all processes (None when no step of the window updated the
        weights: every one was skipped as non-finite)}; starts a new window."""
        total, count = accelerator.reduce(self.sums.clone(), "sum").tolist()
        self.sums.zero_()
        return {"loss": total / count if count else None}

    def local_loss(self) -> float | None:
        """This process's mean loss of the window so far, without ending it or waiting for the others (the timed
        progress line between logging steps)."""
        total, count = self.sums.tolist()
        return total / count if count else None

    def state_dict(self) -> dict[str, list[float]]:
        return {"sums": self.sums.tolist()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.sums.copy_(torch.tensor(state["sums"], dtype=torch.float64))
