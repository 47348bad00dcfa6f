"""One 10 MB row in SFT data: how long its preparation takes, and how long another run preparing other data in the
same cache_dir waits for it (issue 42, point 7).

Two child processes, each preparing as recipes/sft.py does (`prepare_then_join`) its own data in one shared cache_dir: the first gets the
generated digit task plus a file holding one row of 10 MB (one repeated letter: the worst case of BPE tokenizer
training); the second, started a second later, only the digit task with another size. Each is given `--timeout`
seconds. The code measured is whichever `tunebook` the children import: run it again with PYTHONPATH pointing at
another checkout's `src` to measure that one.

    python benchmarks/overlong_row.py --work_dir /tmp/overlong [--timeout 120] [--row_mb 10] [--max_seq_length 1024]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

# What recipes/sft.py runs to prepare its data, on one process.
CHILD = """
import json, logging, sys, time
from pathlib import Path
from types import SimpleNamespace
from tunebook.data.sft import prepare_sft_data
from tunebook.distributed import prepare_then_join
from tunebook.config import SFTConfig
files, cache, max_seq_length = json.loads(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
start = time.perf_counter()
config = SFTConfig(train_data=files, max_seq_length=max_seq_length, eval_split_ratio=0)
one = SimpleNamespace(num_processes=1, process_index=0)
data = prepare_then_join(one, config, prepare_sft_data, cache, logging.getLogger("bench"))
print(json.dumps({"seconds": time.perf_counter() - start, "stats": data.stats, "built": data.built}))
"""


def start(files: list[Path], cache: Path, max_seq_length: int) -> tuple[subprocess.Popen, float]:
    args = [sys.executable, "-c", CHILD, json.dumps([str(f) for f in files]), str(cache), str(max_seq_length)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True), time.monotonic()


def finish(child: tuple[subprocess.Popen, float], deadline: float) -> str:
    process, began = child
    try:
        out, _ = process.communicate(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return f"> {deadline - began:.0f} s (stopped)"
    if process.returncode != 0:
        return f"failed (exit {process.returncode})"
    result = json.loads(out.strip().splitlines()[-1])
    left_out = result["stats"].get("tokenizer_texts_overlong", 0)
    return (
        f"{result['seconds']:.1f} s (built {', '.join(result['built'])}; left out of tokenizer training: {left_out})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work_dir", required=True)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--row_mb", type=float, default=10.0)
    parser.add_argument("--max_seq_length", type=int, default=1024)
    args = parser.parse_args()
    from tunebook.data.synthetic import write_synthetic_task

    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    digits, _ = write_synthetic_task(work / "data", 2000, 10, 0)
    other, _ = write_synthetic_task(work / "data", 1500, 10, 0)
    big = work / "data" / "big.jsonl"
    row = {"instruction": "a" * int(args.row_mb * 1_000_000), "input": "", "output": "ok"}
    big.write_text(json.dumps(row) + "\n")
    first = start([digits, big], work / "cache", args.max_seq_length)
    time.sleep(1.0)  # the first run is into its preparation
    second = start([other], work / "cache", args.max_seq_length)
    second_result = finish(second, second[1] + args.timeout)
    first_result = finish(first, first[1] + args.timeout)
    import datasets
    import tokenizers
    import transformers

    import tunebook

    print(f"- Machine: {platform.processor() or platform.machine()}, {platform.system()} {platform.release()}")
    print(f"- Versions: Python {platform.python_version()}, tokenizers {tokenizers.__version__}, datasets "
          f"{datasets.__version__}, transformers {transformers.__version__}; tunebook from {tunebook.__file__}")  # fmt: skip
    print(f"- Command: `{' '.join(sys.argv)}`")
    print(f"- Date: {time.strftime('%Y-%m-%d')}\n")
    print("| run | preparation |\n| --- | --- |")
    print(f"| digit task + one {args.row_mb:g} MB row, max_seq_length {args.max_seq_length} | {first_result} |")
    print(f"| other data in the same cache_dir, started 1 s later | {second_result} |")


if __name__ == "__main__":
    main()
