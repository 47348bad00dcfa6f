"""What stops a training run safely: preemption signals and non-finite losses, decided the same on every process."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from types import FrameType

import torch
from accelerate import Accelerator

__all__ = ["StopSignals", "TrainCounters", "exit_code", "is_nonfinite", "nonfinite_stop"]


@dataclass
class TrainCounters:
    """This process's running sums, kept on the device so the loop never waits for the host between logs.

    Saved per process in every checkpoint (each rank its own file), so a resumed run continues every sum exactly.
    """

    tokens_seen: torch.Tensor  # non-padding input tokens
    fed_tokens: torch.Tensor  # all input tokens, padding included
    window_loss: torch.Tensor  # summed token losses since the last log
    window_tokens: torch.Tensor  # loss tokens since the last log
    samples_seen: torch.Tensor  # examples (a packed row holds several)

    @classmethod
    def zeros(cls, device) -> TrainCounters:
        dtypes = (torch.long, torch.long, torch.float64, torch.float64, torch.long)
        return cls(*(torch.zeros((), dtype=d, device=device) for d in dtypes))

    def add_batch(self, batch: dict[str, torch.Tensor]) -> None:
        """Count a micro-batch's tokens (real and fed) and examples, without waiting for the device."""
        mask = batch["attention_mask"]
        self.tokens_seen += mask.sum()
        self.fed_tokens += mask.numel()
        if "seq_ids" in batch:  # packed rows: an example starts wherever a real token's position id is 0
            self.samples_seen += ((batch["position_ids"] == 0) & mask.bool()).sum()
        else:
            self.samples_seen += mask.shape[0]

    def state_dict(self) -> dict[str, float | int]:
        return {name: getattr(self, name).item() for name in self.__dataclass_fields__}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).fill_(state.get(name, 0))  # checkpoints from before samples_seen existed

    def pop_window_loss(self, accelerator: Accelerator) -> float:
        """Mean loss per loss token (or example) since the last call, over all processes; starts a new window."""
        loss_total, count = accelerator.reduce(torch.stack([self.window_loss, self.window_tokens]), "sum").tolist()
        self.window_loss.zero_()
        self.window_tokens.zero_()
        return loss_total / max(count, 1)


class StopSignals:
    """Turn SIGTERM and SIGINT into a request to stop after the current optimizer step.

    SLURM preemption sends SIGTERM, Ctrl-C sends SIGINT. The handler only records the signal; the training loop
    asks `requested()` after each optimizer step, saves a checkpoint and exits. A second signal while stopping
    falls back to the default behaviour, so a stuck run can still be killed. Use as a context manager: the
    previous handlers come back on exit (a notebook kernel keeps its own Ctrl-C handling).
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for sig in self.signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some notebook launchers): no signal handling
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # second signal: stop waiting for the step to finish
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.received = signum

    def requested(self, accelerator: Accelerator) -> int | None:
        """The signal to stop for, agreed by all processes (any process that got one stops them all)."""
        local = self.received or 0
        if accelerator.num_processes > 1:
            local = int(accelerator.reduce(torch.tensor(local, device=accelerator.device), "max").item())
        return local or None


def is_nonfinite(loss_sum: torch.Tensor, grad_norm: torch.Tensor | float, accelerator: Accelerator) -> bool:
    """True if the step's loss or gradient norm is NaN/inf on any process (one host sync per step)."""
    loss_bad = ~torch.isfinite(loss_sum.detach().float())
    norm = grad_norm if isinstance(grad_norm, torch.Tensor) else torch.tensor(float(grad_norm))
    norm_bad = ~torch.isfinite(norm.detach().float().to(accelerator.device))
    bad = (loss_bad | norm_bad).float()
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad, "max")
    return bool(bad.item())


def nonfinite_stop(global_step: int, output_dir) -> Exception:
    """The error that ends a run under `nan_policy: stop`, naming the last good checkpoint."""
    from ..checkpoint import list_checkpoints
    from ..errors import TrainingError

    last = list_checkpoints(output_dir)
    return TrainingError(
        f"non-finite loss or gradient norm at step {global_step + 1}; nothing was saved. Last good checkpoint: "
        f"{last[-1] if last else 'none'}. Lower learning_rate, check the data, or set nan_policy: skip"
    )


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (130 for Ctrl-C, 143 SIGTERM)."""
    return 128 + signum if signum else 1
