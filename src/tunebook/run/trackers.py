"""Experiment trackers through Accelerate: which ones a config asks for, and what they receive.

Accelerate does the work (`Accelerator(log_with=...)`, `init_trackers`, `log`, `end_training`); Tunebook adds
what it lacks for a framework default: `auto` (tensorboard when installed), a clear error when a tracker that was
asked for is not installed (Accelerate only logs that at debug level and trains on without it), a config that
every tracker accepts, and local, offline destinations by default.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from ..config import TRACKERS, report_to_names
from ..errors import ConfigError

__all__ = [
    "TRACKERS",
    "log_samples",
    "resolve_report_to",
    "samples_markdown",
    "start_trackers",
    "tracker_values",
    "trackers_dir",
]


def resolve_report_to(report_to: str | list[str]) -> list[str]:
    """The tracker names of a `report_to` value: a name, a comma-separated string, or a list of names.

    `auto` is tensorboard when it is installed (else nothing); `none` is nothing. A named tracker that is not
    installed is an error naming the package to install.
    """
    names = report_to_names(report_to)
    # find_spec, not accelerate.tracking.get_available_trackers: configs are checked before torch is imported.
    available = {name for name in TRACKERS if importlib.util.find_spec(name) is not None}
    chosen: list[str] = []
    for name in names:
        if name == "none":
            continue
        if name == "auto":
            name = "tensorboard"
            if name not in available:
                continue
        if name not in available:
            raise ConfigError(
                f"report_to asks for {name} but it is not installed: pip install {name} "
                "(or pip install 'tunebook[trackers]'), or set report_to: none"
            )
        if name not in chosen:
            chosen.append(name)
    return chosen


def trackers_dir(output_dir: str | Path) -> Path:
    """Where local trackers write: `output_dir/runs` (tensorboard event files, an mlflow file store)."""
    return Path(output_dir) / "runs"


def start_trackers(accelerator, config, recipe: str) -> None:
    """Start the Accelerator's trackers (main process) with the whole config as hyperparameters.

    Local and offline unless told otherwise: mlflow writes to `output_dir/runs/mlruns` unless
    `MLFLOW_TRACKING_URI` is set; wandb follows `WANDB_MODE` (set `offline` without network).
    """
    if not accelerator.log_with:
        return
    if "mlflow" in {str(t) for t in accelerator.log_with}:
        os.environ.setdefault("MLFLOW_TRACKING_URI", (trackers_dir(config.output_dir) / "mlruns").resolve().as_uri())
    hparams = {k: _hparam(v) for k, v in dataclasses.asdict(config).items()}
    accelerator.init_trackers(recipe, config=hparams, init_kwargs={})


def tracker_values(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as tracker scalars, grouped for dashboards: `train/loss`, `eval/loss`, ...

    `step` is the tracker's x axis, not a value; evaluation keys lose their `eval_` prefix to the `eval/` group.
    Non-numeric values (generated text, None) are left to metrics.jsonl.
    """
    values = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        values[f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"] = value
    return values


def log_samples(accelerator, samples: list[dict[str, str]], step: int) -> None:
    """The replies to `sample_prompts` of one evaluation, as each tracker shows text: wandb a table (step, prompt,
    completion), as TRL logs its completions; tensorboard a Markdown table in its Text tab (`samples`). The other
    trackers take numbers only; the replies stay in metrics.jsonl and the log."""
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            rows = [[step, s["prompt"], s["completion"]] for s in samples]
            tracker.log_table("samples", columns=["step", "prompt", "completion"], data=rows, step=step)
        elif tracker.name == "tensorboard":
            tracker.log({"samples": samples_markdown(samples)}, step=step)  # accelerate: add_text for a str


def samples_markdown(samples: list[dict[str, str]]) -> str:
    """Prompts and replies as a Markdown table, each cell on one line (newlines shown as ⏎, `|` escaped; an empty
    reply, a turn ended at once, as *(empty)*)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\r\n", "\n").replace("\n", " ⏎ ") or "*(empty)*"

    rows = [f"| {cell(s['prompt'])} | {cell(s['completion'])} |" for s in samples]
    return "\n".join(["| prompt | completion |", "| --- | --- |", *rows])


def _hparam(value: Any) -> int | float | str | bool:
    """TensorBoard's hparams take only int, float, str and bool: None, lists and dicts become their JSON text."""
    if isinstance(value, bool | int | float | str):
        return value
    return json.dumps(value)
