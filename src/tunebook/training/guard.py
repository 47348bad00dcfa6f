"""What stops a training run safely: preemption signals and non-finite losses, decided the same on every process."""

from __future__ import annotations

import signal
from types import FrameType

import torch
from accelerate import Accelerator

__all__ = ["StopSignals", "exit_code", "is_nonfinite", "nonfinite_stop"]


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
    from ..errors import TrainingError
    from .checkpoint import list_checkpoints

    last = list_checkpoints(output_dir)
    return TrainingError(
        f"non-finite loss or gradient norm at step {global_step + 1}; nothing was saved. Last good checkpoint: "
        f"{last[-1] if last else 'none'}. Lower learning_rate, check the data, or set nan_policy: skip"
    )


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (130 for Ctrl-C, 143 SIGTERM)."""
    return 128 + signum if signum else 1
