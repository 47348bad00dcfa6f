"""`torch_compile` on a CPU: what the first compile costs and what a compiled step saves, eager against compiled.

    python benchmarks/compile_cpu.py [--examples 2000] [--repeats 2] [--hidden 256] [--label NAME] [--src DIR]

recipes/sft.py with packing on Code Alpaca (vs_peers.py's subset and tokenizer), a 4-layer Llama `--hidden` wide
(the issue measured compile on 4 x 256), rows of 512, batch 8, one epoch, no evaluation, fp32. Every run is its own
process, launched as the README does, with an empty inductor cache: the first compile is what a user pays once per
machine. Eager and compiled runs alternate. Reported, as medians: the time from process start to the end of the
first optimizer step, the steady speed (non-padding tokens/s of the logging windows after the first, so the first
compile is not in it), the whole process's wall time, and for compiled runs the graphs' shapes and recompiles.

`--src DIR` runs another checkout's `src` (e.g. a worktree of an older commit) under `--label`, so one table
compares two versions; records gather in `--work_dir`/compile_cpu.jsonl and the section is rebuilt from all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from results import header, write_section
from vs_peers import BATCH, MAX_LEN, ROOT, prepare_assets, tunebook_command

LAYERS = 4


def build_model(work: Path, examples: int, hidden: int) -> tuple[Path, Path]:
    """vs_peers.py's Code Alpaca subset and tokenizer, with a model `hidden` wide (Llama's 8/3 MLP ratio)."""
    data, base = prepare_assets(work, examples, "code_alpaca")
    model_dir = work / f"init_model_h{hidden}"
    if not (model_dir / "config.json").is_file():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(base)
        config = AutoConfig.from_pretrained(base)
        config.update({"hidden_size": hidden, "intermediate_size": hidden * 8 // 3 // 16 * 16,
                       "num_hidden_layers": LAYERS, "num_attention_heads": hidden // 64,
                       "num_key_value_heads": hidden // 64})  # fmt: skip
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    return data, model_dir


def run_one(compiled: bool, data: Path, model_dir: Path, work: Path, src: Path | None) -> dict:
    out = work / ("out-compiled" if compiled else "out-eager")
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "TUNEBOOK_CACHE": str(work / "cache")}  # fmt: skip
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    cmd = tunebook_command(model_dir, data, out, work / "cache", "--logging_steps", "5",
                           "--torch_compile", str(compiled).lower())  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="inductor-") as inductor_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache  # the first compile, as on a fresh machine
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(
            f"{'compiled' if compiled else 'eager'} run failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    summary = json.loads((out / "summary.json").read_text())
    windows = [r["tokens_per_second"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if "loss" in r and "tokens_per_second" in r]  # fmt: skip
    return {
        "compiled": compiled,
        "wall_seconds": wall,
        "time_to_first_step": summary["time_to_first_step_seconds"],
        "steady_tokens_per_second": statistics.median(windows[1:]) if len(windows) > 1 else None,
        "tokens_per_second": summary["train_tokens_per_second"],
        "steps": summary["train_steps"],
        "final_train_loss": summary["final_train_loss"],
        **{k: v for k, v in summary.items() if k.startswith("torch_compile_")},
    }


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def table(records: list[dict]) -> str:
    lines = ["| version | torch_compile | runs | first step (s) | steady tokens/s | whole run (s) | shapes | recompiles "
             "| final loss |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]  # fmt: skip
    for label in dict.fromkeys(r["label"] for r in records):
        for compiled in (False, True):
            runs = [r for r in records if r["label"] == label and r["compiled"] == compiled]
            if not runs:
                continue
            recompiles = max(r.get("torch_compile_recompiles", 0) for r in runs)
            shapes = runs[-1].get("torch_compile_shapes", "dynamic" if compiled else "–")
            lines.append(f"| {label} | {str(compiled).lower()} | {len(runs)} | {_median(runs, 'time_to_first_step'):.1f} "
                         f"| {_median(runs, 'steady_tokens_per_second'):,.0f} | {_median(runs, 'wall_seconds'):.1f} "
                         f"| {shapes if compiled else '–'} | {recompiles if compiled else '–'} "
                         f"| {_median(runs, 'final_train_loss'):.4f} |")  # fmt: skip
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--src", type=Path, help="another checkout's src directory to run instead of this one's")
    parser.add_argument("--work_dir", type=Path, default=Path(tempfile.gettempdir()) / "tunebook_compile_cpu")
    parser.add_argument("--no_write", action="store_true", help="print the table only")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    data, model_dir = build_model(args.work_dir, args.examples, args.hidden)
    records_file = args.work_dir / "compile_cpu.jsonl"
    for _ in range(args.repeats):
        for compiled in (False, True):
            record = {"label": args.label, "hidden": args.hidden, "examples": args.examples,
                      **run_one(compiled, data, model_dir, args.work_dir, args.src)}  # fmt: skip
            print(json.dumps(record), flush=True)
            with open(records_file, "a") as f:
                f.write(json.dumps(record) + "\n")
    records = [json.loads(line) for line in records_file.read_text().splitlines()]
    body = "\n".join([
        *header("torch_compile on a CPU: first compile and steady speed (benchmarks/compile_cpu.py)"),
        f"- Setup: recipes/sft.py with packing, Code Alpaca ({args.examples} examples), a {LAYERS}-layer Llama "
        f"{args.hidden} wide, rows of {MAX_LEN} x {BATCH}, one epoch, fp32, each run its own process with an empty "
        "inductor cache; eager and compiled runs alternate. Steady tokens/s: median of the logging windows (5 steps) "
        "after the first.",
        "",
        table(records),
    ])  # fmt: skip
    print(body)
    if not args.no_write:
        write_section("compile_cpu", body)


if __name__ == "__main__":
    main()
