"""`tunebook plan` against `torch.cuda.max_memory_allocated` on a GPU: the Llama-3.2-1B shape (random weights from
its config.json, no download) trained by SFT (full and LoRA), DPO (LoRA) and GRPO (LoRA, transformers generation)
for a few steps, each run's own summary.json holding the plan made at its start beside the measured peak.

    python benchmarks/plan_gpu.py --out DIR [--cases sft,sft-lora,dpo-lora,grpo-lora] [--steps 4]
    python benchmarks/plan_gpu.py --from_records DIR/plan_gpu.jsonl     # the RESULTS.md section, here

Rows are full (packed SFT with a loss on every token; DPO pairs padded to max_seq_length), as the plan assumes;
no evaluation runs (the plan is of training). Each case is its own `tunebook train` process (bf16, one GPU).
Records (one JSON object per case) are appended to DIR/plan_gpu.jsonl as they come.
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
MODEL = ROOT / "tests" / "assets" / "model_configs" / "meta-llama--Llama-3.2-1B" / "config.json"
COMMON = ["--model_config", str(MODEL), "--eval_on_start", "false", "--save_strategy", "no", "--report_to", "none",
          "--per_device_eval_batch_size", "1", "--sample_prompts", "[]", "--eval_split_ratio", "0.01",
          "--torch_compile", "false", "--logging_steps", "1"]  # fmt: skip
CASES = {
    "sft": ["sft", "--packing", "true", "--assistant_only_loss", "false", "--max_seq_length", "2048",
            "--per_device_train_batch_size", "4", "--synthetic_train_size", "6000", "--generation_eval", "false"],
    "sft-lora": ["sft", "--packing", "true", "--assistant_only_loss", "false", "--max_seq_length", "2048",
                 "--per_device_train_batch_size", "8", "--synthetic_train_size", "12000", "--use_peft", "true",
                 "--generation_eval", "false"],
    "sft-checkpointing": ["sft", "--packing", "true", "--assistant_only_loss", "false", "--max_seq_length", "4096",
                          "--per_device_train_batch_size", "8", "--synthetic_train_size", "24000",
                          "--gradient_checkpointing", "true", "--generation_eval", "false"],
    "dpo-lora": ["dpo", "--use_peft", "true", "--max_seq_length", "512", "--pad_to_multiple_of", "512",
                 "--per_device_train_batch_size", "8", "--sft_warmup_steps", "0"],
    "grpo-lora": ["grpo", "--use_peft", "true", "--beta", "0.04", "--per_device_train_batch_size", "8",
                  "--num_generations", "8", "--max_new_tokens", "256", "--sft_warmup_steps", "0"],
}  # fmt: skip


def run(name: str, out: Path, steps: int) -> dict:
    run_dir = out / "runs" / name
    command = [sys.executable, "-m", "tunebook.cli", "train", "--config_file",
               str(ROOT / "accelerate_configs" / "single_gpu.yaml"), *CASES[name], *COMMON, "--max_steps", str(steps),
               "--output_dir", str(run_dir), "--overwrite_output_dir", "true"]  # fmt: skip
    start = time.time()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (out / f"{name}.log").write_text(done.stdout + done.stderr)
    summary_file = run_dir / "summary.json"
    if done.returncode or not summary_file.exists():
        return {"case": name, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    memory = json.loads(summary_file.read_text()).get("memory", {})
    planned, measured = memory.get("planned_allocated_gib"), memory.get("measured_peak_allocated_gib")
    return {"case": name, "args": CASES[name], "steps": steps, "seconds": time.time() - start, **memory,
            "ratio": planned / measured if planned and measured else None}  # fmt: skip


def table(records: list[dict]) -> str:
    rows = ["| case | planned allocated GiB | measured max_memory_allocated GiB | planned / measured | planned peak "
            "(with context and slack) GiB | device GiB |", "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in records:
        if "error" in r:
            rows.append(f"| {r['case']} | failed: {r['error']} | | | | |")
            continue
        rows.append(f"| {r['case']} | {r['planned_allocated_gib']:.2f} | {r['measured_peak_allocated_gib']:.2f} | "
                    f"{r['ratio']:.3f} | {r['planned_peak_gib']:.2f} | {r['device_memory_gib']:.1f} |")  # fmt: skip
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-out")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--from_records", help="write the RESULTS.md section from a records file, running nothing")
    args = parser.parse_args()
    if args.from_records:
        records = [json.loads(line) for line in Path(args.from_records).read_text().splitlines() if line.strip()]
        text = "\n".join([*header("Memory plan vs max_memory_allocated, GPU (benchmarks/plan_gpu.py)"), "",
                          table(records)])  # fmt: skip
        write_section("plan_gpu", text + f"\n\nRaw records: `{args.from_records}`.")
        print(table(records))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.cases.split(","):
        record = run(name, out, args.steps)
        with (out / "plan_gpu.jsonl").open("a") as f:  # as they come: a part cut at its limit keeps what it did
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
