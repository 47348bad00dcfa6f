"""Prepare once, train anywhere: cold vs warm data preparation, and `tunebook prepare` with 1 vs 2 processes.

    python benchmarks/data_prep.py [--examples 400000]

Generates a synthetic instruction data set large enough that cold preparation (tokenizer training, tokenisation,
packing) takes well over 30 s, then measures:
- `tunebook prepare --dataset_num_proc 1` and `--dataset_num_proc 2`, each into an empty cache (whole command);
- `data_prep_seconds` of a training run (`recipes/sft.py`, one step) with an empty cache, and again with the cache
  the first run left (the warm one must take under a tenth of the cold one).
Results go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from results import header, write_section

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512}  # fmt: skip


def write_data(path: Path, n: int) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from tunebook.data.synthetic import make_example

    if path.is_file() and sum(1 for _ in path.open()) == n:
        return
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps(make_example(rng, 4, 12)) + "\n")


def timed(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    result = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=400_000)
    parser.add_argument("--work_dir", default="/tmp/tunebook-data-prep")
    parser.add_argument("--no_write", action="store_true")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "train.jsonl"
    write_data(data, args.examples)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    common = ["--train_data", str(data), "--packing", "true", "--max_seq_length", "512"]
    tunebook = str(Path(sys.executable).parent / "tunebook")

    prepare = {}
    for num_proc in (1, 2):
        cache = work / f"cache-prepare-{num_proc}"
        shutil.rmtree(cache, ignore_errors=True)
        prepare[num_proc] = timed([tunebook, "prepare", *common, "--cache_dir", str(cache),
                                   "--dataset_num_proc", str(num_proc)], env)  # fmt: skip
        print(f"tunebook prepare, num_proc {num_proc}: {prepare[num_proc]:.1f} s", flush=True)

    cache = work / "cache-train"
    shutil.rmtree(cache, ignore_errors=True)
    runs = {}
    for label in ("cold", "warm"):
        out = work / f"out-{label}"
        launch = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--quiet",
            "--config_file",
            str(ROOT / "accelerate_configs" / "cpu.yaml"),
            str(ROOT / "recipes" / "sft.py"),
        ]
        timed([*launch, *common, "--cache_dir", str(cache), "--dataset_num_proc", "2", "--model_config",
               json.dumps(TINY), "--max_steps", "1", "--disable_tqdm", "true", "--output_dir", str(out)], env)  # fmt: skip
        summary = json.loads((out / "summary.json").read_text())
        runs[label] = summary
        print(f"training run, {label} cache: data_prep_seconds {summary['data_prep_seconds']:.2f}", flush=True)

    cold, warm = runs["cold"]["data_prep_seconds"], runs["warm"]["data_prep_seconds"]
    stats = runs["cold"]["data"]
    lines = [
        *header("Data preparation: cold vs warm cache, 1 vs 2 processes (benchmarks/data_prep.py)"),
        f"- Data: {args.examples:,} generated synthetic-task examples ({data.stat().st_size / 2**20:.0f} MB of JSONL), "
        f"{stats['train_tokens_per_epoch']:,} tokens, packed at max_seq_length 512 into {stats['packed_rows']:,} rows "
        f"(packing efficiency {stats['packing_efficiency']:.4f}). Preparation = local tokenizer training, "
        "tokenisation with loss masks, packing, each written to the cache.",
        "",
        "| what | seconds |",
        "| --- | ---: |",
        f"| `tunebook prepare`, dataset_num_proc 1, empty cache (whole command) | {prepare[1]:.1f} |",
        f"| `tunebook prepare`, dataset_num_proc 2, empty cache (whole command) | {prepare[2]:.1f} |",
        f"| training run `data_prep_seconds`, empty cache (num_proc 2) | {cold:.1f} |",
        f"| training run `data_prep_seconds`, warm cache | {warm:.2f} |",
        "",
        f"Warm/cold: {warm / cold:.3f} (target < 0.1). 2 processes vs 1: {prepare[1] / prepare[2]:.2f}x faster.",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("data_prep", text)


if __name__ == "__main__":
    main()
