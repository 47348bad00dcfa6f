"""Training memory does not grow with the data: ~20 MB vs ~2 GB of tokenised data, same model, same steps.

    python benchmarks/memory_scaling.py [--small_mb 20] [--large_mb 2000] [--steps 40]

Generates two instruction data sets of the synthetic digit task with long inputs, prepares each with
`tunebook prepare` (tokenised into memory-mapped Arrow in the cache), then trains the same tiny Llama for the same
number of steps on each through `accelerate launch recipes/sft.py`, sampling the anonymous resident memory
(RssAnon: heap and tensors; memory-mapped file pages are reclaimable and not counted) of the training process
and of its whole process tree (DataLoader workers included) every 20 ms. The peaks of the two runs must differ
by less than 300 MB. Results go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from results import header, write_section

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512}  # fmt: skip
# Measured: a tokenised row (input_ids, labels, prompt length) takes ~11.5 bytes per token in the Arrow cache.
BYTES_PER_TOKEN = 11.5
TOKENS_PER_EXAMPLE = 230  # a 200-digit input, its reversal, and the template


def write_data(path: Path, megabytes: int, seed: int) -> int:
    """JSONL of long digit-reversal examples, sized to give about `megabytes` of tokenised Arrow data."""
    n = int(megabytes * 2**20 / (BYTES_PER_TOKEN * TOKENS_PER_EXAMPLE))
    if path.is_file() and sum(1 for _ in path.open()) == n:
        return n
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            digits = "".join(rng.choices("0123456789", k=rng.randint(90, 110)))
            f.write(json.dumps({"instruction": "Reverse the digits.", "input": digits, "output": digits[::-1]}) + "\n")
    return n


def rss_anon_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            children = []
        for c in map(int, children):
            out.append(c)
            todo.append(c)
    return out


def run_measured(cmd: list[str], env: dict) -> dict:
    """Run `cmd`, sampling RssAnon of the training process (the largest) and of the whole tree."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = {"process_mb": 0.0, "tree_mb": 0.0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            sizes = [rss_anon_kib(p) for p in [proc.pid, *descendants(proc.pid)]]
            peak["process_mb"] = max(peak["process_mb"], max(sizes) / 1024)
            peak["tree_mb"] = max(peak["tree_mb"], sum(sizes) / 1024)
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    output = proc.stdout.read()
    proc.wait()
    done.set()
    thread.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed:\n{output[-4000:]}")
    return peak


def dir_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small_mb", type=int, default=20)
    parser.add_argument("--large_mb", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--num_proc", type=int, default=2)
    parser.add_argument("--work_dir", default="/tmp/tunebook-memory")
    parser.add_argument("--no_write", action="store_true")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    # One tokenizer for both runs, trained on the small set by a first prepare.
    tokenizer_dir = work / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        sys.path.insert(0, str(ROOT / "src"))
        from tunebook.models import train_chat_tokenizer

        texts = ["user\nReverse the digits.\n0123456789", "assistant\n9876543210"] * 50
        train_chat_tokenizer(texts, vocab_size=300).save_pretrained(tokenizer_dir)

    rows = []
    for name, megabytes in (("small", args.small_mb), ("large", args.large_mb)):
        data = work / f"{name}.jsonl"
        examples = write_data(data, megabytes, seed=1)
        cache = work / f"cache-{name}"
        common = ["--train_data", str(data), "--tokenizer_name_or_path", str(tokenizer_dir), "--cache_dir", str(cache),
                  "--max_seq_length", "512", "--dataset_num_proc", str(args.num_proc)]  # fmt: skip
        start = time.perf_counter()
        prep = subprocess.run([str(Path(sys.executable).parent / "tunebook"), "prepare", *common], env=env, cwd=ROOT,
                              capture_output=True, text=True)  # fmt: skip
        if prep.returncode != 0:
            raise RuntimeError(prep.stdout[-2000:] + prep.stderr[-3000:])
        prep_seconds = time.perf_counter() - start
        out = work / f"out-{name}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--quiet",
               "--config_file", str(ROOT / "accelerate_configs" / "cpu.yaml"), str(ROOT / "recipes" / "sft.py"),
               *common, "--model_config", json.dumps(TINY), "--max_steps", str(args.steps),
               "--per_device_train_batch_size", "8", "--disable_tqdm", "true", "--logging_steps", "10", "--output_dir", str(out)]  # fmt: skip
        peak = run_measured(cmd, env)
        summary = json.loads((out / "summary.json").read_text())
        rows.append(
            {
                "name": name,
                "examples": examples,
                "tokens": summary["data"]["train_tokens_per_epoch"],
                "cache_mb": dir_mb(cache / "prepared"),
                "prep_seconds": prep_seconds,
                **peak,
                "peak_rss_mb": summary["peak_rss_mb"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    small, large = rows
    diff = large["process_mb"] - small["process_mb"]
    diff_tree = large["tree_mb"] - small["tree_mb"]
    lines = [
        *header("Memory does not grow with the data (benchmarks/memory_scaling.py)"),
        f"- Same tiny Llama (4 layers, hidden 128), same tokenizer, {args.steps} optimizer steps of batch 8 on each "
        "data set (synthetic long-digit reversal, prepared first with `tunebook prepare`). Peak anonymous resident "
        "memory (RssAnon, sampled every 20 ms): of the training process, and summed over its process tree "
        "(DataLoader workers and the launcher included). `peak_rss_mb` is the training process's own peak RSS, "
        "mapped data pages included.",
        "",
        "| data set | examples | tokens | tokenised cache (MB) | prepare (s) | peak RssAnon, training process (MB) "
        "| peak RssAnon, process tree (MB) | peak RSS incl. mapped pages (MB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['examples']:,} | {r['tokens']:,} | {r['cache_mb']:.0f} | {r['prep_seconds']:.0f} "
            f"| {r['process_mb']:.0f} | {r['tree_mb']:.0f} | {r['peak_rss_mb']:.0f} |"
        )
    verdict = "meets" if abs(diff) < 300 and abs(diff_tree) < 300 else "MISSES"
    lines += ["", f"Difference large - small: {diff:+.0f} MB (training process), {diff_tree:+.0f} MB (process tree): "
              f"{verdict} the < 300 MB target."]  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("memory_scaling", text)


if __name__ == "__main__":
    main()
