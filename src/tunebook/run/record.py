"""The run record: what a run writes down about itself. Its clock (`RunTimer`), `metrics.jsonl` (also sent to the
trackers), the summary every recipe returns and writes to `summary.json` (`run_summary`), the library versions,
peak memory, and the end of a run's record (`finish_run`: summary.json, report.png, the model card, the headline).
"""

from __future__ import annotations

import json
import logging
import math
import platform
import resource
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml

from ..errors import owns_process
from ..process import launch_time
from .report import flatten, format_table, render_report, resumed_step

__all__ = [
    "MetricsWriter",
    "RunTimer",
    "data_wait_advice",
    "finish_run",
    "headline",
    "peak_rss_mb",
    "run_summary",
    "versions",
    "write_summary",
]

logger = logging.getLogger("tunebook")


class MetricsWriter:
    """Append one JSON object per call to `output_dir/metrics.jsonl` (main process only)."""

    def __init__(self, path: str | Path, enabled: bool, resume_step: int | None = None, accelerator=None):
        """A fresh file, or with `resume_step` the existing one cut after that step's records.

        With `accelerator`, every record also goes to its trackers (`tunebook.run.trackers.tracker_values`).

        A run resumed from the checkpoint of step N continues at N + 1, so what an interrupted run logged after
        its last checkpoint is dropped: no step is missing or logged twice.
        """
        self.path = Path(path)
        self.enabled = enabled
        self.accelerator = accelerator
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if resume_step is not None and self.path.is_file():
                for line in self.path.read_text().splitlines():
                    try:
                        if json.loads(line)["step"] <= resume_step:
                            kept.append(line + "\n")
                    except (ValueError, KeyError):  # a line cut short by the crash
                        continue
            self.path.write_text("".join(kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(_jsonable(record)) + "\n")
            if self.accelerator is not None and self.accelerator.trackers:
                from .trackers import log_samples, tracker_values

                self.accelerator.log(tracker_values(_jsonable(record)), step=record["step"])
                if record.get("samples"):  # replies to sample_prompts: text, which tracker_values leaves out
                    log_samples(self.accelerator, record["samples"], record["step"])


class RunTimer:
    """Wall-clock bookkeeping of a training run.

    Time from the command's start (`tunebook.process.launch_time`) to the first optimizer step; training time that excludes evaluation and
    checkpointing inside the loop (`paused()`); the time the loop waited for its next batch (`add_data_wait`);
    and, per logging window, the training time and data wait that `tunebook.training.Throughput` turns into rates.
    """

    def __init__(self):
        self.process_start = launch_time()
        self.run_start = time.time()
        self.train_start: float | None = None
        self.first_step_done: float | None = None
        self.paused_seconds = 0.0
        self.data_wait_seconds = 0.0
        self.first_batch_seconds: float | None = None
        self._mark = (time.perf_counter(), 0.0, 0.0)  # time, paused and data wait at the last window

    def start_training(self) -> None:
        # Pauses before the start (the evaluation before training) are not inside the training time to subtract.
        self.train_start, self.paused_seconds = time.perf_counter(), 0.0
        self._mark = (self.train_start, self.paused_seconds, self.data_wait_seconds)

    def step_done(self) -> None:
        if self.first_step_done is None:
            self.first_step_done = time.time()

    def add_data_wait(self, seconds: float) -> None:
        if self.first_batch_seconds is None:
            # The loader's start-up (workers spawned, a stream's first group read) is a one-off cost inside
            # time_to_first_step; data wait is whether the pipeline keeps up, which a short run's start-up would
            # drown (a 20-step streamed run: 0.06-0.11 with it, ~0.01 without). Later epochs' restarts do count.
            self.first_batch_seconds = seconds
            return
        self.data_wait_seconds += seconds

    @contextmanager
    def paused(self):
        """Time inside this block (evaluation, checkpoint saves) does not count as training time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_seconds += time.perf_counter() - start

    def window(self) -> tuple[float, float]:
        """(training seconds, seconds waited for data) since the previous call or the start of training."""
        now = time.perf_counter()
        then, paused, waited = self._mark
        self._mark = (now, self.paused_seconds, self.data_wait_seconds)
        return max(now - then - (self.paused_seconds - paused), 1e-9), self.data_wait_seconds - waited

    @property
    def time_to_first_step(self) -> float | None:
        return None if self.first_step_done is None else self.first_step_done - self.process_start

    def wall_seconds(self) -> float:
        """Seconds since the command started (`tunebook train`, `accelerate launch`, `python recipes/...`); in a
        caller's interpreter (a notebook's `main(config)`), whose process may be hours old, since the run started."""
        return time.time() - (self.process_start if owns_process() else self.run_start)

    def train_runtime(self) -> float:
        if self.train_start is None:
            return 0.0
        return time.perf_counter() - self.train_start - self.paused_seconds

    def data_wait_fraction(self) -> float:
        runtime = self.train_runtime()
        return min(self.data_wait_seconds / runtime, 1.0) if runtime > 0 else 0.0


def data_wait_advice(
    fraction: float,
    num_workers: int,
    prefetch_factor: int,
    threshold: float = 0.05,
    data_built: bool = False,
    streamed: bool = False,
) -> str | None:
    """What to change when the training loop waited for data more than `threshold` of its time, else None.
    `data_built`: this run tokenised its data (rather than finding every cache built); `streamed`: its training data
    is tokenised as it trains (streaming: true)."""
    if fraction <= threshold:
        return None
    if streamed:  # the workers tokenise (and pack) the stream: more of them, or no tokenising at all
        fix = (
            f"raise dataloader_num_workers (now {num_workers}): each worker tokenises its own share of the stream; "
            "give the corpus a multiple of processes x workers files so that no worker reads rows it skips, or "
            "tokenise it ahead with `tunebook prepare` and stream the prepared shards"
        )
    elif num_workers == 0:
        fix = "set dataloader_num_workers (now 0) to 2 or more so batches are collated in the background"
    else:
        fix = f"raise dataloader_num_workers (now {num_workers}) or dataloader_prefetch_factor (now {prefetch_factor})"
    prepare = (
        "; prepare the data ahead with `tunebook prepare` if preprocessing is the slow part"
        if data_built and not streamed
        else ""
    )
    return f"The training loop waited for data {100 * fraction:.0f}% of the time (more than {100 * threshold:.0f}%): {fix}{prepare}"


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if platform.system() == "Darwin" else rss / 1024


def versions() -> dict[str, str]:
    import accelerate
    import datasets
    import torch
    import transformers

    from .. import __version__

    return {
        "tunebook": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "datasets": datasets.__version__,
        "python": platform.python_version(),
    }


def write_summary(path: str | Path, summary: dict[str, Any]) -> None:
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_jsonable(summary), indent=2) + "\n")
    tmp.replace(path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    return value


def run_summary(
    recipe: str,
    config,
    accelerator,
    throughput,
    data,
    timer,
    counters,
    best,
    *,
    global_step: int,
    final_train_loss: float | None,
    final_eval: dict[str, Any],
    eval_before: dict[str, Any],
    skipped_updates: int,
    resumed_from,
    stopped_early: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """Everything a run reports, totalled over all processes; call it on every process (it reduces across them).

    `throughput` is the run's `Throughput` (FLOPs per token, device peak), `timer` its `RunTimer`, `counters` its
    `TrainCounters` (tokens and examples seen, tokens fed), `best` its `BestModel` or None, `data` the prepared
    data (its `seconds` and `stats`). `extra` adds recipe-specific keys. Logs the data-loading advice when the loop
    waited for data.
    """
    train_runtime = timer.train_runtime()
    totals = torch.stack([counters.tokens_seen, counters.fed_tokens, counters.samples_seen])
    tokens, fed, samples = accelerator.reduce(totals, "sum").tolist()
    local_wait = torch.tensor(timer.data_wait_fraction(), device=accelerator.device)
    data_wait = accelerator.reduce(local_wait, "mean").item()
    workers, prefetch = config.dataloader_num_workers, config.dataloader_prefetch_factor
    streamed = getattr(data, "stream", None) is not None
    if advice := data_wait_advice(data_wait, workers, prefetch, data_built=bool(data.built), streamed=streamed):
        logger.warning(advice)
    summary = {
        "recipe": recipe,
        "train_steps": global_step,
        "train_tokens": int(tokens),
        "train_runtime_seconds": train_runtime,
        "train_tokens_per_second": tokens / train_runtime if train_runtime > 0 else 0.0,
        "train_samples": int(samples),
        "train_samples_per_second": samples / train_runtime if train_runtime > 0 else 0.0,
        "time_to_first_step_seconds": timer.time_to_first_step,
        "data_prep_seconds": data.seconds,
        "data_wait_fraction": data_wait,
        "first_batch_wait_seconds": timer.first_batch_seconds,
        "final_train_loss": final_train_loss,
        "eval": final_eval,
        "eval_before_training": eval_before,
        "best": best.state_dict() if best else None,
        "stopped_early": stopped_early,
        "skipped_updates": skipped_updates,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "padding_fraction": 1 - tokens / fed if fed else 0.0,
        "packing_efficiency": tokens / fed if getattr(config, "packing", False) and fed else None,
        **extra,
        "data": data.stats,
        "peak_rss_mb": peak_rss_mb(),  # host memory, on a GPU too
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "versions": versions(),
        "output_dir": str(Path(config.output_dir)),
    }
    # model FLOPs per token, MFU (GPUs of known peak, or peak_flops), peak memory
    summary.update(throughput.summary(summary["train_tokens_per_second"]))
    return summary


def finish_run(
    output_dir: str | Path,
    summary: dict[str, Any],
    log: logging.Logger = logger,
    metric: tuple[str, str, str] | None = None,
    wall_seconds: float | None = None,
) -> None:
    """Write `summary.json`, `report.png` and the model card (`README.md`) into `output_dir`, with `push_to_hub` in
    the run's `config.yaml` upload the model directory (main process, after the model was saved), and end with the
    run's headline (`headline`: `metric` is the recipe's main one). The whole summary is a table in the log at debug
    level (`log_level: DEBUG`) and `tunebook report OUTPUT_DIR` prints it; summary.json holds it all."""
    # Imported here: `tunebook report` uses this module and must not load the data and model stack.
    from .model_card import load_line, write_model_card
    from .upload import push_output_dir

    output_dir = Path(output_dir)
    write_summary(output_dir / "summary.json", summary)
    written = ["summary.json (every figure)"]
    try:
        log.debug("Report: %s", render_report([output_dir], output_dir / "report.png"))
        written.append("report.png (the curves)")
    except Exception as error:  # a plot must never cost the run its outputs
        log.warning("report.png not written: %s", error)
    shown = {k: v for k, v in flatten(summary).items() if not k.startswith(("versions.", "data."))}
    log.debug("Run summary:\n%s", format_table(["", output_dir.name], [[k, v] for k, v in shown.items()]))
    # The recipes write the resolved config at start-up; it says what the card describes and where to push.
    config_path = output_dir / "config.yaml"
    config = (yaml.safe_load(config_path.read_text()) or {}) if config_path.is_file() else {}
    try:
        log.debug("Model card: %s", write_model_card(output_dir, summary, config))
        written.append("README.md (the model card)")
    except Exception as error:  # like the plot, a card must never cost the run its outputs
        log.warning("README.md (model card) not written: %s", error)
    if config.get("push_to_hub"):
        push_output_dir(output_dir, config, summary.get("recipe") or "training", log)
    where = str(summary.get("output_dir") or output_dir)  # as the config gave it: what the user typed
    load = load_line(output_dir, summary.get("recipe") or "", where)
    for line in headline(summary, metric, wall_seconds=wall_seconds, outputs=written, load=load):
        log.info("%s", line)


def headline(
    summary: dict[str, Any],
    metric: tuple[str, str, str] | None = None,
    *,
    wall_seconds: float | None = None,
    outputs: list[str] | tuple[str, ...] = (),
    load: str | None = None,
) -> list[str]:
    """The few lines a run ends with, from its summary: what training did (steps, time, speed, final loss), the
    recipe's main eval metric before and after training, where the outputs are, and a line of Python that loads
    the model. Everything else is in summary.json.

    Args:
        summary: the run's summary (`run_summary`).
        metric: (eval key, name, format) of the recipe's main metric, e.g. ("eval_exact_match", "exact match",
            ".3f"); without it, the eval loss.
        wall_seconds: the run's time from its command's start (None: not shown).
        outputs: what was written beside the model, e.g. "summary.json (every figure)".
        load: one line of Python that loads the saved model (None: no model was saved).
    """
    steps, tokens_per_second = summary.get("train_steps") or 0, summary.get("train_tokens_per_second")
    resumed = resumed_step(summary.get("resumed_from"))  # this run's time and speed are of the steps after it
    if resumed is not None and resumed < steps:
        trained = f"steps {resumed + 1:,}-{steps:,}"
    else:
        trained = f"{steps:,} step{'s' * (steps != 1)}"
    done = f"Trained {trained} in {_duration(summary.get('train_runtime_seconds'))}"
    if wall_seconds is not None:
        done += f" ({_duration(wall_seconds)} in all)"
    if tokens_per_second:
        done += f", {tokens_per_second:,.0f} tokens/s"
    if summary.get("final_train_loss") is not None:
        done += f", final train loss {_number(summary['final_train_loss'], '.4f')}"
    notes = []
    if summary.get("resumed_from"):
        notes.append(f"resumed from {summary['resumed_from']}")
    if summary.get("stopped_early"):
        notes.append("stopped early: the eval metric stopped improving")
    if summary.get("skipped_updates"):
        notes.append(f"{summary['skipped_updates']} non-finite step(s) skipped")
    lines = [done + (f" ({'; '.join(notes)})" if notes else "")]
    after, before = summary.get("eval") or {}, summary.get("eval_before_training") or {}
    key, name, fmt = metric if metric and metric[0] in after else ("eval_loss", "loss", ".4f")
    if key in after:
        was = "n/a" if before.get(key) is None else _number(before[key], fmt)
        line = f"Eval {name}: {was} before training -> {_number(after[key], fmt)} after"
        if key not in ("eval_loss", "eval_perplexity") and "eval_loss" in after and "eval_loss" in before:
            line += f" (eval loss {_number(before['eval_loss'], '.4f')} -> {_number(after['eval_loss'], '.4f')})"
        lines.append(line)
    where = summary.get("output_dir")
    if where:
        what = "processor" if "ImageTextToText" in (load or "") else "tokenizer"
        saved = [f"the model and {what}"] if load else ["no model saved"]
        lines.append(f"Outputs in {where}: {', '.join([*saved, *outputs])}")
    if load:
        lines.append(f"Load it: {load}")
    return lines


def _duration(seconds: float | None) -> str:
    """'12.3 s', '4 min 05 s', '2 h 07 min'."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def _number(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, int | float) else str(value)  # "nan" from summary.json is a str
