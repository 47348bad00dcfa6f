"""What a run holds and what it saves, as explicit objects, each given whole where it is made: `Run` (from start to
end: the config, Accelerator, log, clock, folders), `Plan` (how long it trains), `RunState` and `Checkpointed` (what
a checkpoint saves and a resumed run loads back) and `Training` (what the loop holds while it trains). The functions
that make and use them are in `tunebook.training.loop`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from .best import BestModel
from .counters import TrainCounters
from .guard import StopSignals

__all__ = ["Checkpointed", "Plan", "Run", "RunState", "Training"]


@dataclass
class RunState:
    """Where the loop is, saved whole in every checkpoint (`trainer_state.json`)."""

    global_step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # this epoch's micro-batches already trained on (per process)
    skipped_updates: int = 0  # non-finite steps dropped under nan_policy: skip
    last_train_loss: float | None = None  # the mean over the last logging window (summary.json's final_train_loss)
    eval_history: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> evaluation results

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> RunState:
        known = {k: v for k, v in state.items() if k in cls.__dataclass_fields__}
        known["eval_history"] = {int(step): m for step, m in (known.get("eval_history") or {}).items()}
        return cls(**known)


@dataclass
class Run:
    """What a run holds from its start to its end, all of it given by `start_run`: the config, the Accelerator, the
    log, the clock, the output and cache folders, the output_dir's lock and the stop-signal handlers. `stop` is what
    ends the run early (a non-finite step, a stop signal, a failed save), raised by `finish` once the model is freed."""

    config: Any
    recipe: str
    accelerator: Accelerator
    log: logging.Logger
    timer: Any  # tunebook.run.record.RunTimer
    output_dir: Path
    cache_dir: Path
    output_lock: Any = None  # tunebook.run.output_lock.OutputDirLock, released when the run ends
    memory_plan: dict | None = None  # the planned peak (tunebook.planning.at_start), recorded beside the measured
    signals: StopSignals = field(default_factory=StopSignals)
    stop: BaseException | None = None


@dataclass(frozen=True)
class Plan:
    """How long the run trains, from the prepared loader: optimizer steps in all and per epoch, and the forward
    passes (micro-batches) per process that makes."""

    total_steps: int
    steps_per_epoch: int
    micro_batches: int


@dataclass
class Checkpointed:
    """What a checkpoint holds besides the model, optimizer and schedule, and a resumed run loads back: fresh or
    loaded by `load_checkpoint_or_start`. `registered` are further objects of this process saved by name (each with
    `state_dict`/`load_state_dict`: GRPO's rollouts still to train on)."""

    state: RunState  # shared: trainer_state.json
    counters: TrainCounters  # this process's
    figures: Any  # this process's logged training figures: add(...), pop(accelerator) -> {"loss": ...}
    best: BestModel | None  # shared: the best checkpoint, early stopping (None without evaluation)
    registered: dict[str, Any]
    resumed_from: Path | None  # the checkpoint loaded; None on a fresh start


@dataclass
class Training:
    """What the loop holds while it trains, given whole by `start_training`: the plan, the checkpointed state, the
    prepared objects, the data, the evaluation, and what logs the run (metrics.jsonl, progress bar, throughput, the
    timed progress lines)."""

    plan: Plan
    saved: Checkpointed
    model: Any
    optimizer: Any
    lr_scheduler: Any
    train_loader: Any
    data: Any  # the prepared data: its tokenizer goes into checkpoints, the summary reads it
    evaluation: Callable[[], dict[str, Any]] | None  # the recipe's evaluation; None: there is no eval data
    compiled: Any  # tunebook.training.compilation.CompiledBlocks with torch_compile, else None
    metrics: Any  # tunebook.run.record.MetricsWriter
    progress: Any
    throughput: Any  # tunebook.training.Throughput
    heartbeat: Any = None  # tunebook.training.throughput.Heartbeat on the main process: timed lines between logs
    samples: Callable[[], list[dict[str, str]]] | None = None  # replies to sample_prompts (evaluation.prompt_sampler)

    @property
    def state(self) -> RunState:
        return self.saved.state

    @property
    def counters(self) -> TrainCounters:
        return self.saved.counters
