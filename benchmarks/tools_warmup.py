"""Does the GRPO tools default's SFT warm-up learn to copy? Held-out greedy exact match after the warm-up, per
seed and warm-up learning rate.

    python benchmarks/tools_warmup.py [--seeds 42,1,2,3] [--learning_rates 3e-3,1e-3] [--jobs 2] [--no_write]

The tools default (recipes/configs/grpo/tools_default.yaml) relies on its 500 warm-up steps teaching a 2-layer
model to copy the numbers into the calculator call and the result into its answer, an ability that appears
abruptly. Each case runs the default as a user starts it, with one GRPO step so that the evaluation before training
(greedy episodes on the 64 held-out prompts) measures the warm-up alone. Cases run `--jobs` at a time, one thread
each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import header, write_section

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "recipes/configs/grpo/tools_default.yaml"


def start(seed: int, learning_rate: str, out: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TUNEBOOK_CACHE": str(out / "cache")}
    command = [
        str(Path(sys.executable).with_name("tunebook")), "train", "--config_file", "accelerate_configs/cpu.yaml",
        "grpo", "--config", CONFIG, "--output_dir", str(out / "run"), "--disable_tqdm", "true", "--max_steps", "1",
        "--eval_steps", "100", "--seed", str(seed), "--sft_warmup_learning_rate", learning_rate,
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="42,1,2,3")
    parser.add_argument("--learning_rates", default="3e-3,1e-3")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--no_write", action="store_true")
    args = parser.parse_args()
    cases = [(lr, int(s)) for lr in args.learning_rates.split(",") for s in args.seeds.split(",")]
    results = {}
    with tempfile.TemporaryDirectory(prefix="tools-warmup-") as tmp:
        pending, running = list(cases), {}
        while pending or running:
            while pending and len(running) < args.jobs:
                case = pending.pop(0)
                out = Path(tmp) / f"{case[0]}-{case[1]}"
                running[case] = (start(case[1], case[0], out), out, time.monotonic())
            time.sleep(2)
            for case, (process, out, began) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[case]
                if process.returncode != 0:
                    raise SystemExit(f"{case}: the run failed:\n{process.stderr.read()[-3000:]}")
                summary = json.loads((out / "run" / "summary.json").read_text())
                results[case] = (summary["eval_before_training"]["eval_exact_match"], time.monotonic() - began)
                print(case, results[case], flush=True)
    seeds = args.seeds.split(",")
    lines = [
        *header("GRPO tools default: does the SFT warm-up learn to copy? (benchmarks/tools_warmup.py)"),
        f"- Setup: `{CONFIG}` (500 constant-rate warm-up steps, batch 32, gradient clipping 1), one GRPO step; "
        "held-out greedy exact match (64 prompts) before it, i.e. after the warm-up alone. One thread per run, "
        f"{args.jobs} at a time.",
        "",
        "| warm-up learning rate | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "| --- | " + " | ".join("---:" for _ in seeds) + " |",
    ]
    for lr in args.learning_rates.split(","):
        lines.append(f"| {lr} | " + " | ".join(f"{results[(lr, int(s))][0]:.2f}" for s in seeds) + " |")
    lines += [
        "",
        "A run that learnt to copy ends near 1; one that did not stays near the 0.1 of answering without the "
        "tool's result. The CI run of 2026-11-28 (another CPU) failed test_grpo_tools at 3e-3, seed 42, which had "
        "passed on the machine it was tuned on: the ability appears abruptly, and at 3e-3 whether it does within 500 "
        "steps turned on float rounding. The default now warms up at 1e-3.",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("tools_warmup", text)


if __name__ == "__main__":
    main()
