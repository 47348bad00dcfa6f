"""Does the offline GRPO default learn from its rewards? recipes/grpo.py's embedded default, over seeds, and a control.

    python benchmarks/grpo_default.py [--seeds 42 1 2] [--work_dir /tmp/tunebook-grpo]

Each run is `tunebook train --config_file accelerate_configs/cpu.yaml grpo` with nothing changed but the seed (which
also draws the synthetic prompts, the tokenizer's data and the warm-up): 200 SFT warm-up steps, then 60 GRPO steps
with the exact-match reward. The control runs the same steps with `grpo_controls.py:shuffled_exact_match`: each batch's
exact-match rewards shuffled among its completions, so the rewards keep their mean and spread but say nothing
about the completion they are paired with. If the control learns too, the gain is not the reward's (it would be
the learning-rate decay's, say). Records the held-out exact match when GRPO starts and at each evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from results import header, write_section

ROOT = Path(__file__).resolve().parents[1]
TUNEBOOK = str(Path(sys.executable).with_name("tunebook"))


def run(work: Path, name: str, seed: int, extra: list[str]) -> dict:
    out = work / name
    cmd = [TUNEBOOK, "train", "--config_file", str(ROOT / "accelerate_configs" / "cpu.yaml"), "grpo",
           "--seed", str(seed), "--disable_tqdm", "true", "--output_dir", str(out), *extra]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{name} failed:\n{done.stderr[-4000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_exact_match"]) for r in records if "eval_exact_match" in r]
    rewards = [r["reward"] for r in records if "reward" in r and "loss" in r]
    return {"name": name, "seed": seed, "evals": evals, "reward": (rewards[0], rewards[-1]), "wall": wall}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    parser.add_argument("--work_dir", default="/tmp/tunebook-grpo")
    parser.add_argument("--no_write", action="store_true")
    args = parser.parse_args()
    work = Path(args.work_dir)
    control = [
        "--reward_functions",
        f"[{Path(__file__).with_name('grpo_controls.py').resolve()}:shuffled_exact_match]",
    ]
    runs = [run(work, f"default-seed{s}", s, []) for s in args.seeds]
    runs.append(run(work, f"control-seed{args.seeds[0]}", args.seeds[0], control))
    steps = [step for step, _ in runs[0]["evals"]]
    lines = [
        *header("The GRPO default learns from its rewards (benchmarks/grpo_default.py)"),
        "- Each run: `tunebook train --config_file accelerate_configs/cpu.yaml grpo --seed S` (the embedded default:",
        "  200 SFT warm-up steps at a constant 1e-3, then 60 GRPO steps, 16 prompts x 8 completions, exact-match",
        "  reward). Control: the same, with each batch's rewards shuffled among its completions.",
        "- Held-out exact match of greedy answers (200 prompts); step 0 is after the warm-up, when GRPO starts.",
        "",
        "| run | " + " | ".join(f"step {s}" for s in steps) + " | sampled reward, first -> last log | wall |",
        "| --- | " + " | ".join("---:" for _ in steps) + " | ---: | ---: |",
    ]
    for r in runs:
        cells = " | ".join(f"{em:.3f}" for _, em in r["evals"])
        lines.append(f"| {r['name']} | {cells} | {r['reward'][0]:.2f} -> {r['reward'][1]:.2f} | {r['wall']:.0f} s |")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("grpo_default", text)


if __name__ == "__main__":
    main()
