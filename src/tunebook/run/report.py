"""Run reports: `report.png` from `metrics.jsonl`, the summary as a table, and several runs side by side.

Every recipe ends with `finish_run` (summary.json, report.png, the summary table in the log, the model card and,
with `push_to_hub`, the upload: see `tunebook.run.model_card`); `tunebook report RUN_DIR [RUN_DIR ...]` re-renders the plots
and prints the runs' summaries and differing config keys in columns.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError

__all__ = ["compare_runs", "flatten", "format_cell", "format_table", "read_metrics", "render_report"]

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

    One line per run, labelled with its directory name; a panel with nothing to show says so.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display: training machines and CI have none
    import matplotlib.pyplot as plt

    runs = [(Path(d).name, *read_metrics(d)) for d in run_dirs]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    # Fixed margins: constrained_layout measured every tick label and doubled the time to draw (~0.45 s -> ~0.2 s).
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.07, top=0.92, wspace=0.22, hspace=0.32)
    panels = [
        (axes[0, 0], "Loss", [("loss", "train", "-"), ("eval_loss", "eval", "o--")], "log"),
        (axes[0, 1], "Eval metrics", None, "linear"),
        (axes[0, 2], "Learning rate", [("learning_rate", "", "-")], "linear"),
        (axes[1, 0], "Gradient norm", [("grad_norm", "", "-")], "log"),
        (axes[1, 1], "Tokens/s (all processes)", [("tokens_per_second", "", "-")], "linear"),
        (axes[1, 2], "Data wait and MFU (fractions)", [("data_wait_fraction", "data wait", "-"), ("mfu", "MFU", ":")],
         "linear"),
    ]  # fmt: skip
    for ax, title, series, scale in panels:
        drawn = False
        for i, (name, train, evals) in enumerate(runs):
            prefix = f"{name} " if len(runs) > 1 else ""
            color = {"color": f"C{i}"} if len(runs) > 1 else {}  # one colour per run; series differ by line style
            if series is None:  # every score the evaluations reported (exact match, accuracy, F1, ...)
                keys = sorted({k for r in evals for k in r if k.startswith("eval_") and k not in _NOT_SCORES})
                series_here = [(k, k.removeprefix("eval_"), "o-") for k in keys]
            else:
                series_here = series
            for key, label, style in series_here:
                records = evals if key.startswith("eval_") else train
                points = [(r["step"], r[key]) for r in records if _finite(r.get(key))]
                if points:
                    ax.plot(*zip(*points), style, label=(prefix + label).strip() or None, markersize=3, **color)
                    drawn = True
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        if drawn:
            ax.set_yscale(scale if _positive(ax) else "linear")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.suptitle(", ".join(name for name, *_ in runs))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


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


def _positive(ax) -> bool:
    """Whether every plotted value is > 0 (a log scale needs it)."""
    return all(min(line.get_ydata(), default=1) > 0 for line in ax.get_lines())
