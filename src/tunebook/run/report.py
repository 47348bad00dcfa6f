"""Run reports: `report.png` from `metrics.jsonl`, the summary as a table, and several runs side by side.

Every recipe ends with `finish_run` (summary.json, report.png, the model card, with `push_to_hub` the upload, and a
few headline lines in the log: see `tunebook.run.record`); `tunebook report RUN_DIR [RUN_DIR ...]` re-renders the
plots and prints the runs' summaries and differing config keys in columns. The plots are drawn on a figure of their
own, never through pyplot: a notebook's backend and figures stay as they were.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError

__all__ = [
    "compare_runs",
    "flatten",
    "format_cell",
    "format_table",
    "read_metrics",
    "render_report",
    "report_figure",
    "resumed_step",
]

logger = logging.getLogger("tunebook")

# Eval keys that are counts or timings, not scores: not plotted as metrics.
_NOT_SCORES = {"eval_loss", "eval_tokens", "eval_examples", "eval_pairs", "eval_perplexity"}


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a run's `metrics.jsonl`, in step order; a line cut short is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{path}: no metrics.jsonl (is {run_dir} a Tunebook run directory?)")
    train, evals = [], []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        (train if "loss" in record else evals).append(record)
    return train, evals


def render_report(run_dirs: list[str | Path], path: str | Path) -> Path:
    """Plot loss and eval curves, learning rate, grad norm, tokens/s and data wait (and MFU) of runs into `path`.

    One line per run, labelled with its directory name; a panel with nothing to show says so. Drawn on a figure of
    its own (`report_figure`): pyplot and the process's matplotlib backend are left as they were, so a notebook's
    `%matplotlib inline` still shows its plots after `main(config)`.
    """
    figure = report_figure(run_dirs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path


def report_figure(run_dirs: list[str | Path]):
    """The report's `matplotlib.figure.Figure` on an Agg canvas of its own, six panels (see `render_report`), made
    without pyplot.

    The learning rate starts at step 0 with the schedule's first value (0 under a warm-up), so the warm-up shows
    whatever `logging_steps` is; a resumed run's restart is a dotted vertical line; a series that never changes
    gets a range around its value, not matplotlib's ±0.04 around a flat 0.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = [_Run.read(Path(d)) for d in run_dirs]
    last = max((r["step"] for run in runs for r in run.train + run.evals), default=0) or 1
    figure = Figure(figsize=(15, 8))
    FigureCanvasAgg(figure)  # its own canvas, no display needed (training machines and CI have none)
    axes = figure.subplots(2, 3)
    # Fixed margins: constrained_layout measured every tick label and doubled the time to draw (~0.45 s -> ~0.2 s).
    figure.subplots_adjust(left=0.06, right=0.985, bottom=0.07, top=0.92, wspace=0.26, hspace=0.35)
    panels = [
        (axes[0, 0], "Loss", "loss", [("loss", "train", "-"), ("eval_loss", "eval", "o--")], "log"),
        (axes[0, 1], "Eval metrics", "score", None, "linear"),
        (axes[0, 2], "Learning rate", "learning rate", [("learning_rate", "", "-")], "linear"),
        (axes[1, 0], "Gradient norm (before clipping)", "L2 norm", [("grad_norm", "", "-")], "log"),
        (axes[1, 1], "Throughput (all processes)", "tokens / s", [("tokens_per_second", "", "-")], "linear"),
        (axes[1, 2], "Data wait and MFU", "fraction (0-1)",
         [("data_wait_fraction", "data wait", "-"), ("mfu", "MFU", ":")], "linear"),
    ]  # fmt: skip
    for ax, title, ylabel, series, scale in panels:
        values = []
        for i, run in enumerate(runs):
            prefix = f"{run.name} " if len(runs) > 1 else ""
            color = {"color": f"C{i}"} if len(runs) > 1 else {}  # one colour per run; series differ by line style
            if series is None:  # every score the evaluations reported (exact match, accuracy, F1, ...)
                keys = sorted({k for r in run.evals for k in r if k.startswith("eval_") and k not in _NOT_SCORES})
                series_here = [(k, k.removeprefix("eval_"), "o-") for k in keys]
                # lm-evaluation-harness figures (eval_harness_tasks): `harness/<task>/<metric>`, dotted
                harness = sorted({k for r in run.evals for k in r if k.startswith("harness/")})
                series_here += [(k, k.removeprefix("harness/"), "s:") for k in harness]
            else:
                series_here = series
            for key, label, style in series_here:
                points = run.points(key)
                if points:
                    marker = (
                        {"marker": "o"} if len(points) == 1 and not set(style) & set("os") else {}
                    )  # one point: no line
                    ax.plot(*zip(*points), style, label=(prefix + label).strip() or None, markersize=3, **marker,
                            **color)  # fmt: skip
                    values += [v for _, v in points]
        _style_axes(ax, title, ylabel, values, scale)
        ax.set_xlim(-0.02 * last, 1.02 * last)  # every panel from step 0 to the last, one point or many
        for i, run in enumerate(runs):
            if values and run.resumed_at is not None:  # after the scale and range: the marker spans whatever they are
                ax.axvline(run.resumed_at, color=f"C{i}" if len(runs) > 1 else "gray", linestyle=":", linewidth=1.2,
                           label=f"{run.name} resumed" if len(runs) > 1 else "resumed")  # fmt: skip
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    figure.suptitle(", ".join(run.name for run in runs))
    return figure


@dataclass
class _Run:
    """What a report plots of one run: its records and, from its config and summary, the learning rate at step 0
    and the step a resumed run continued from."""

    name: str
    train: list[dict]
    evals: list[dict]
    start_lr: float | None
    resumed_at: int | None

    @classmethod
    def read(cls, run_dir: Path) -> _Run:
        train, evals = read_metrics(run_dir)
        config, summary = _read_yaml(run_dir / "config.yaml"), _read_json(run_dir / "summary.json")
        return cls(run_dir.name, train, evals, _schedule_start(config), resumed_step(summary.get("resumed_from")))

    def points(self, key: str) -> list[tuple[int, float]]:
        records = self.evals if key.startswith(("eval_", "harness/")) else self.train
        points = [(r["step"], r[key]) for r in records if _finite(r.get(key))]
        if key == "learning_rate" and points and points[0][0] > 0 and self.start_lr is not None:
            points.insert(0, (0, self.start_lr))  # the warm-up's start, before the first logged step
        return points


def _schedule_start(config: dict[str, Any]) -> float | None:
    """The learning rate the schedule starts at (the one the first step trains at): every warm-up of the schedules
    `lr_scheduler_type` offers ramps from 0; `constant` has none. None without the run's config."""
    learning_rate = config.get("learning_rate")
    if not _finite(learning_rate):
        return None
    warmup = (config.get("warmup_ratio") or 0) > 0 and config.get("lr_scheduler_type") != "constant"
    return 0.0 if warmup else float(learning_rate)


def resumed_step(checkpoint: str | None) -> int | None:
    """The step a resumed run continued from: its checkpoint is `checkpoints/step-<N>` (`training.checkpoint`)."""
    found = re.fullmatch(r"step-(\d+)", Path(checkpoint).name) if checkpoint else None
    return int(found[1]) if found else None


def _style_axes(ax, title: str, ylabel: str, values: list[float], scale: str) -> None:
    """Title, labels, scale and range of a panel with `values` plotted on it; readable ticks."""
    from matplotlib.ticker import MaxNLocator, NullFormatter

    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 9.6, 9.8, 10.0 around one point
    if not values:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        return
    ax.set_ylabel(ylabel)
    low, high = min(values), max(values)
    if high - low <= 1e-9 * max(abs(low), abs(high)):  # constant: a range around it, not ±0.04 or offset ticks
        ax.set_ylim(*((-0.05, 1.0) if low == 0 else sorted((0.5 * low, 1.5 * low))))
    elif scale == "log" and low > 0 and high / low >= 10:  # a decade or more: powers of ten are labelled
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks overlap one another
    ax.yaxis.set_major_formatter(_tick_formatter())  # no offset ("1e-5" above the axis) or 5x10^0 labels


def _tick(value: float, low: float, high: float) -> str:
    """A tick label on an axis from `low` to `high`: decimals ('0', '0.25', '12,500') or, on an axis whose largest
    value is under 0.01 or a million and more, powers of ten ('5e-4', '1.5e-3'), the same kind on the whole axis; never an
    offset or '5x10^0'. A value under a billionth of the axis's span is float noise around 0 (5.6e-17)."""
    if value == 0 or abs(value) < 1e-9 * abs(high - low):
        return "0"
    if 0.01 <= max(abs(low), abs(high)) < 1e6:
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _tick_formatter():
    from matplotlib.ticker import Formatter

    class Ticks(Formatter):
        def __call__(self, value, pos=None):
            return _tick(value, *self.axis.get_view_interval())

    return Ticks()


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
    except (OSError, yaml.YAMLError):
        return {}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def compare_runs(run_dirs: list[str | Path]) -> str:
    """Runs' summaries side by side, led by the config keys whose values differ between them."""
    names, summaries, configs = [], [], []
    for d in map(Path, run_dirs):
        summary_path = d / "summary.json"
        if not summary_path.is_file():
            raise ConfigError(f"{summary_path}: not found (a run writes it when it finishes)")
        names.append(d.name)
        summaries.append(flatten(json.loads(summary_path.read_text())))
        config_path = d / "config.yaml"
        configs.append((yaml.safe_load(config_path.read_text()) or {}) if config_path.is_file() else {})
    rows = []
    for key in sorted(set().union(*configs)):
        values = [c.get(key, "") for c in configs]
        if len({json.dumps(v, sort_keys=True, default=str) for v in values}) > 1:
            rows.append([f"config.{key}", *values])
    for key in dict.fromkeys(k for s in summaries for k in s):  # first-seen order keeps the summary's layout
        if not key.startswith("versions."):
            rows.append([key, *(s.get(key, "") for s in summaries)])
    return format_table(["", *names], rows)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level with dotted keys: {"eval": {"eval_loss": 1}} -> {"eval.eval_loss": 1}."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def format_table(header: list[str], rows: list[list[Any]]) -> str:
    """A plain-text table: left-aligned first column, right-aligned values, numbers to 4 significant digits."""
    cells = [[str(c) for c in header]] + [[str(row[0])] + [format_cell(v) for v in row[1:]] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def format_cell(value: Any) -> str:
    """A value as a table shows it: thousands separated, floats to 4 significant places, None as '-'."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.4g}"
        return f"{value:,.4f}".rstrip("0").rstrip(".") if abs(value) < 1e3 else f"{value:,.1f}"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
