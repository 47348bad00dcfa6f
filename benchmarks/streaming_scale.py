"""Streamed pretraining: time to the first optimizer step and peak memory do not grow with the corpus.

    python benchmarks/streaming_scale.py [--sizes_mb 20 1000 5000] [--steps 20] [--workers 2]

Writes one JSONL corpus per size (random documents of 50-600 words; the larger ones repeat a 20 MB block, which
changes nothing for a reader that never looks back), then trains the default pretrain model on each for the same
number of steps through `accelerate launch recipes/pretrain.py` with `train_data: {path: ..., streaming: true}`
and a tokenizer trained once beforehand, sampling the anonymous resident memory (RssAnon) of the training process
and of its process tree (loader workers included) every 20 ms. Reports the time to the first optimizer step
(`time_to_first_step_seconds`, from the command's start), the peaks, `data_wait_fraction`, and that no Arrow copy of
the corpus was written to the cache. Results go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

from memory_scaling import dir_mb, run_measured
from results import header, write_section

ROOT = Path(__file__).resolve().parents[1]
BLOCK_MB = 20


def write_corpus(path: Path, megabytes: int, block: Path) -> None:
    if path.is_file() and abs(path.stat().st_size / 2**20 - megabytes) < BLOCK_MB:
        return
    with path.open("wb") as out, block.open("rb") as source:
        data = source.read()
        for _ in range(max(1, round(megabytes / BLOCK_MB))):
            out.write(data)


def write_block(path: Path) -> None:
    if path.is_file():
        return
    rng = random.Random(0)
    words = [f"w{i}" for i in range(2000)] + "the of and to in is was for on that with as by at".split()
    with path.open("w") as f:
        size = 0
        while size < BLOCK_MB * 2**20:
            line = json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(50, 600)))}) + "\n"
            f.write(line)
            size += len(line)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes_mb", type=int, nargs="+", default=[20, 1000, 5000])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work_dir", default="/tmp/tunebook-streaming")
    parser.add_argument("--no_write", action="store_true")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    block = work / "block.jsonl"
    write_block(block)
    tokenizer_dir = work / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        sys.path.insert(0, str(ROOT / "src"))
        from tunebook.models import train_chat_tokenizer

        texts = [json.loads(line)["text"] for _, line in zip(range(2000), block.open())]
        train_chat_tokenizer(texts, vocab_size=512).save_pretrained(tokenizer_dir)

    rows = []
    for megabytes in args.sizes_mb:
        corpus = work / f"corpus-{megabytes}mb.jsonl"
        write_corpus(corpus, megabytes, block)
        cache, out = work / f"cache-{megabytes}", work / f"out-{megabytes}"
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--quiet", "--num_cpu_threads_per_process", "1",
               "--config_file", str(ROOT / "accelerate_configs" / "cpu.yaml"), str(ROOT / "recipes" / "pretrain.py"),
               "--train_data", json.dumps({"path": str(corpus), "streaming": True}),
               "--tokenizer_name_or_path", str(tokenizer_dir), "--cache_dir", str(cache), "--output_dir", str(out),
               "--max_steps", str(args.steps), "--logging_steps", "5", "--dataloader_num_workers", str(args.workers),
               "--eval_on_start", "false", "--disable_tqdm", "true", "--report_to", "none"]  # fmt: skip
        start = time.perf_counter()
        peak = run_measured(cmd, env)
        summary = json.loads((out / "summary.json").read_text())
        windows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
        steady = [w["data_wait_fraction"] for w in windows[1:] if "data_wait_fraction" in w]
        rows.append(
            {
                "corpus_mb": corpus.stat().st_size / 2**20,
                "first_step_s": summary["time_to_first_step_seconds"],
                "wall_s": time.perf_counter() - start,
                **peak,
                "data_wait": summary["data_wait_fraction"],
                "first_batch_s": summary["first_batch_wait_seconds"],
                "steady_wait": sum(steady) / max(len(steady), 1),  # the windows after the first (start-up) one
                "cache_mb": dir_mb(cache),
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    lines = [
        *header("Streamed pretraining: first step and memory vs corpus size (benchmarks/streaming_scale.py)"),
        f"- The default pretrain model (tiny Llama, hidden 128), {args.steps} optimizer steps of 16 rows x 256 tokens, "
        f"{args.workers} loader workers, one JSONL file streamed (`streaming: true`), a tokenizer trained beforehand. "
        "Peak anonymous resident memory (RssAnon, sampled every 20 ms) of the training process and of its process "
        "tree (workers and launcher); the cache holds no copy of the corpus (its size is the last column).",
        "",
        "| corpus (MB) | first optimizer step (s) | whole run (s) | peak RssAnon, training process (MB) "
        "| peak RssAnon, process tree (MB) | first batch wait (s) | data_wait_fraction, run | after the first window "
        "| cache written (MB) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['corpus_mb']:,.0f} | {r['first_step_s']:.1f} | {r['wall_s']:.0f} | {r['process_mb']:.0f} "
            f"| {r['tree_mb']:.0f} | {r['first_batch_s']:.1f} | {r['data_wait']:.3f} | {r['steady_wait']:.3f} "
            f"| {r['cache_mb']:.1f} |"
        )
    lines += ["", "The first batch waits for the workers to start and tokenise their first group: start-up, inside the "
              "first step's time and reported apart (`first_batch_wait_seconds`), not in `data_wait_fraction`."]  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("streaming_scale", text)


if __name__ == "__main__":
    main()
