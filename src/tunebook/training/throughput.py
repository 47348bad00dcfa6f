"""How fast a run goes and how well it uses the hardware: per logging window and for the whole run."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..models.lora import parameter_counts
from ..models.wrappers import unwrap
from ..planning.flops import dataset_flop_shape, device_peak_flops, mfu, model_flops_per_token
from ..run.record import peak_rss_mb

__all__ = ["Heartbeat", "Throughput", "format_duration", "peak_memory"]


class Throughput:
    """Tokens/s, samples/s, data wait, MFU and peak memory of each logging window, over all processes.

    Build it after resuming (it starts from the restored counters, so the first window after a resume counts only
    its own tokens) and call `window()` on every process at each logging step: it reduces across processes.

    Args:
        accelerator: the run's `Accelerator`.
        model: the (prepared) model; its linear layers and config give the FLOPs per token.
        dataset: the prepared training set; its example lengths and label share give the attention span and
            the LM head's share of the FLOPs (`dataset_flop_shape`).
        timer: the run's `RunTimer` (training time without pauses, data wait).
        counters: the run's `TrainCounters` (tokens and examples seen by this process).
        peak_flops: peak FLOP/s of one device (the config's `peak_flops`); default from the GPU table.
    """

    def __init__(self, accelerator, model, dataset, timer, counters, peak_flops: float | None = None):
        self.accelerator, self.timer, self.counters = accelerator, timer, counters
        self.attention_span, head_fraction = dataset_flop_shape(dataset)
        unwrapped = unwrap(model)
        self.flops_per_token = model_flops_per_token(unwrapped, self.attention_span, head_fraction)
        self.parameters = parameter_counts(unwrapped)  # trainable vs total: LoRA trains a small share
        self.peak_flops = device_peak_flops(accelerator.device, peak_flops)
        self._seen = self._totals()[:2]

    def _totals(self, data_wait_fraction: float = 0.0) -> list[float]:
        """[tokens, samples, sum of the processes' data-wait fractions] over all processes."""
        c = self.counters
        wait = torch.tensor(data_wait_fraction, dtype=torch.float64, device=c.tokens_seen.device)
        return self.accelerator.reduce(
            torch.stack([c.tokens_seen.double(), c.samples_seen.double(), wait]), "sum"
        ).tolist()

    def window(self) -> dict[str, Any]:
        """The figures of the logging window since the previous call (one all-reduce)."""
        seconds, waited = self.timer.window()
        tokens, samples, wait_sum = self._totals(min(waited / seconds, 1.0))
        new_tokens, new_samples = tokens - self._seen[0], samples - self._seen[1]
        self._seen = [tokens, samples]
        record = {
            "tokens_per_second": new_tokens / seconds,
            "samples_per_second": new_samples / seconds,
            "data_wait_fraction": wait_sum / self.accelerator.num_processes,
            "train_tokens": int(tokens),
        }
        utilisation = mfu(self.flops_per_token, new_tokens / seconds, self.accelerator.num_processes, self.peak_flops)
        if utilisation is not None:
            record["mfu"] = utilisation
        return {**record, **peak_memory(self.accelerator.device)}

    def summary(self, tokens_per_second: float) -> dict[str, Any]:
        """The run summary's efficiency keys, for the run's mean `tokens_per_second` over all processes."""
        return {
            "model_flops_per_token": self.flops_per_token,
            "attention_span": self.attention_span,
            "peak_flops_per_device": self.peak_flops,
            "mfu": mfu(self.flops_per_token, tokens_per_second, self.accelerator.num_processes, self.peak_flops),
            **self.parameters,
            **peak_memory(self.accelerator.device),
        }


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak memory so far: the CUDA caching allocator's on a GPU (allocated and reserved), else the process's RSS."""
    if device.type == "cuda":
        return {
            "peak_device_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20,
            "peak_device_memory_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20,
        }
    return {"peak_rss_mb": peak_rss_mb()}


class Heartbeat:
    """A progress line between logging steps, so a slow run is never silent for long: after the first optimizer step
    (a first line within seconds of the start) and then whenever `every_seconds` have passed since the last line,
    whatever `logging_steps` says. A logging step's own line counts as one. The line is for the log only: the
    window's figures and `metrics.jsonl` are untouched, and it reads this process's counters, with no collective, so
    only the main process needs to ask (`due`).

    Args:
        every_seconds: the longest silence between lines (the config's `log_every_seconds`).
        timer: the run's `RunTimer` (training time without evaluations and saves, for the rate and the ETA).
        counters: this process's `TrainCounters` (tokens seen).
        processes: how many processes train alike (this process's rate times it is the run's).
        step: the optimizer step the loop starts from (a resumed run's).
        clock: seconds, monotonic (a fake one in tests).
    """

    def __init__(self, every_seconds: float, timer, counters, processes: int, step: int,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.every_seconds, self.timer, self.counters, self.processes = every_seconds, timer, counters, processes
        self.clock, self.last = clock, None
        self.start_step, self.start_tokens = step, int(counters.tokens_seen)

    def due(self, logged: bool) -> bool:
        """After an optimizer step: whether to log a timed line now. `logged`: the step logged its own line."""
        now = self.clock()
        if logged:
            self.last = now
            return False
        if self.last is None or now - self.last >= self.every_seconds:
            self.last = now
            return True
        return False

    def figures(self, step: int, total_steps: int, loss: float | None) -> dict[str, str]:
        """The line's figures: step, the window's loss so far (this process's), tokens/s, elapsed and ETA."""
        runtime = self.timer.train_runtime()
        steps = max(step - self.start_step, 1)
        tokens = (int(self.counters.tokens_seen) - self.start_tokens) * self.processes
        shown = {"loss so far": "-" if loss is None else f"{loss:.4f}"}
        shown["tok/s"] = f"{tokens / runtime:,.0f}" if runtime > 0 else "-"
        shown["elapsed"] = format_duration(time.perf_counter() - self.timer.train_start)  # evaluations included
        shown["ETA"] = format_duration(runtime / steps * (total_steps - step))
        return shown


def format_duration(seconds: float) -> str:
    """42s, 5m07s, 1h02m: a duration as a progress line shows it."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
