"""How long the defaults take: every recipe's default run and every notebook, against the budgets the issues set.

    python benchmarks/default_runs.py [--only sft,classify,notebooks] [--no_write]

Each recipe runs as a user starts it (`tunebook train --config_file accelerate_configs/cpu.yaml RECIPE`, nothing
else on the command line) in a fresh process with an empty Tunebook cache, so tokenising and building the tiny model
are timed too; each notebook runs top to bottom in a fresh kernel under nbclient, as `tests/notebooks` runs it.
Times are wall-clock from launch to exit. The budgets are issue 2's (`make train` under 3 minutes on 2 CPU cores),
issue 5's (the classification default within 2 minutes) and issue 7's (each notebook under 3 minutes); they are
measured here, not asserted in the tests, where a busy machine would make them fail for no fault of the code.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import header, write_section

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["sft", "classify", "pretrain", "dpo", "reward", "grpo"]
BUDGETS = {"sft": 180, "classify": 120}  # seconds; issue 2 (make train) and issue 5
NOTEBOOK_BUDGET = 180  # issue 7, each notebook
# The line a recipe ends with that says what training did, e.g. "Eval exact match: 0.000 before training -> 0.953".
OUTCOME = re.compile(r"INFO tunebook: (.*before training -> .*)")


def run_recipe(name: str, work: Path) -> tuple[float, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TUNEBOOK_CACHE": str(work / "cache")}
    command = [
        str(Path(sys.executable).with_name("tunebook")), "train", "--config_file", "accelerate_configs/cpu.yaml",
        name, "--output_dir", str(work / "out"), "--disable_tqdm", "true",
    ]  # fmt: skip
    start = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if result.returncode != 0:
        raise SystemExit(f"{name}: the default run failed:\n{result.stderr[-3000:]}")
    outcomes = OUTCOME.findall(result.stdout + result.stderr)
    return seconds, outcomes[-1] if outcomes else "–"


def run_notebook(path: Path, work: Path) -> float:
    import nbformat
    from nbclient import NotebookClient

    os.environ.update(HF_HUB_OFFLINE="1", TUNEBOOK_CACHE=str(work / "cache"))  # the kernel inherits them
    notebook = nbformat.read(path, as_version=4)
    start = time.monotonic()
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(work)}}).execute()
    return time.monotonic() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join([*RECIPES, "notebooks"]), help="comma-separated recipes/notebooks")
    parser.add_argument("--no_write", action="store_true")
    args = parser.parse_args()
    chosen = args.only.split(",")
    rows = []
    for name in [r for r in RECIPES if r in chosen]:
        with tempfile.TemporaryDirectory(prefix=f"default-{name}-") as tmp:
            seconds, outcome = run_recipe(name, Path(tmp))
        budget = BUDGETS.get(name)
        rows.append((f"`tunebook train {name}` (default config)", seconds, budget, outcome))
        print(rows[-1], flush=True)
    if "notebooks" in chosen:
        for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
            with tempfile.TemporaryDirectory(prefix=f"notebook-{path.stem}-") as tmp:
                seconds = run_notebook(path, Path(tmp))
            rows.append((f"notebooks/{path.name}", seconds, NOTEBOOK_BUDGET, "–"))
            print(rows[-1], flush=True)
    lines = [
        *header("How long the defaults take (benchmarks/default_runs.py)"),
        "- Setup: each recipe's default config on `accelerate_configs/cpu.yaml`, a fresh process and an empty cache "
        "(tokenising and model building included); each notebook in a fresh kernel under nbclient. Wall-clock "
        "seconds from launch to exit, one run each.",
        "",
        "| run | seconds | budget (s) | within | what the run reports |",
        "| --- | ---: | ---: | --- | --- |",
    ]
    for what, seconds, budget, outcome in rows:
        within = "–" if budget is None else ("yes" if seconds <= budget else "**no**")
        lines.append(f"| {what} | {seconds:.0f} | {budget or '–'} | {within} | {outcome} |")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("default_runs", text)


if __name__ == "__main__":
    main()
