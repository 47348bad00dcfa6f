"""Do the six default runs give the same numbers as before a change? A lasting tool for refactors.

    python benchmarks/same_numbers.py record NUMBERS.json [--tree PATH] [--only sft,dpo]
    python benchmarks/same_numbers.py compare BEFORE.json AFTER.json

`record` runs each recipe's default config as a user starts it (`tunebook train --config_file
accelerate_configs/cpu.yaml RECIPE`) in a fresh process with an empty cache, from the source tree `--tree` (default:
this checkout; give a clone of the starting commit to record "before"), and keeps every number the run wrote to
`metrics.jsonl` and `summary.json` except those that measure time, speed or the machine. `compare` prints each value
that differs and exits 1 if any does: a renovation that should not change behaviour must print nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

RECIPES = ["sft", "classify", "pretrain", "dpo", "reward", "grpo"]
# Keys whose values depend on the clock, the machine or the process, not on the computation.
VARYING = re.compile(r"(time|second|per_s|/s$|_s$|wait_fraction|throughput|tokens_per|samples_per|steps_per|mfu|flops|memory|"
                     r"date|host|pid|path|dir|version|started|finished|elapsed|eta|rss|_at$)", re.I)  # fmt: skip


def numbers(value, prefix=""):
    """The numeric leaves of a JSON value, keyed by their path; time-like keys left out."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not VARYING.search(str(key)):
                yield from numbers(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from numbers(item, f"{prefix}[{index}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield prefix, value


def record_one(name: str, tree: Path, work: Path) -> dict:
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "TUNEBOOK_CACHE": str(work / "cache"),
        "PYTHONPATH": str(tree / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }  # fmt: skip
    out = work / "out"
    command = [
        str(Path(sys.executable).with_name("tunebook")), "train", "--config_file", "accelerate_configs/cpu.yaml",
        name, "--output_dir", str(out), "--disable_tqdm", "true",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name}: the default run failed:\n{result.stderr[-3000:]}")
    found = {}
    for index, line in enumerate((out / "metrics.jsonl").read_text().splitlines()):
        found.update({f"metrics[{index}].{k}": v for k, v in numbers(json.loads(line))})
    summary = out / "summary.json"
    if summary.exists():
        found.update({f"summary.{k}": v for k, v in numbers(json.loads(summary.read_text()))})
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("output")
    rec.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    rec.add_argument("--only", default=",".join(RECIPES))
    cmp = sub.add_parser("compare")
    cmp.add_argument("before")
    cmp.add_argument("after")
    args = parser.parse_args()
    if args.command == "record":
        results = {}
        for name in args.only.split(","):
            with tempfile.TemporaryDirectory(prefix=f"same-{name}-") as tmp:
                results[name] = record_one(name, Path(args.tree).resolve(), Path(tmp))
            print(f"{name}: {len(results[name])} numbers", flush=True)
            Path(args.output).write_text(json.dumps(results, indent=1, sort_keys=True))
        return
    before, after = (json.loads(Path(p).read_text()) for p in (args.before, args.after))
    differ = 0
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name, {}), after.get(name, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                differ += 1
                print(f"{name} {key}: {a.get(key)!r} -> {b.get(key)!r}")
        print(f"{name}: {len(a)} numbers before, {len(b)} after", flush=True)
    print("same numbers" if not differ else f"{differ} values differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
