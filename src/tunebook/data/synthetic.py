"""A generated instruction task for the offline default and the tests: digit-string transformations.

Each example asks for one operation on a string of digits ("Reverse the digits." / "Sort the digits." on
"48213") and has one exact answer, so exact match of greedy generations measures whether fine-tuning worked:
a tiny model learns it in a couple of CPU minutes, an untrained one scores about 0.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

__all__ = ["SYNTHETIC_TASKS", "make_example", "write_synthetic_task"]

SYNTHETIC_TASKS = {
    "Reverse the digits.": lambda s: s[::-1],
    "Sort the digits in ascending order.": lambda s: "".join(sorted(s)),
}


def make_example(rng: random.Random, min_len: int = 4, max_len: int = 7) -> dict[str, str]:
    """One Alpaca-format record: {instruction, input, output}."""
    instruction = rng.choice(list(SYNTHETIC_TASKS))
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))
    return {"instruction": instruction, "input": digits, "output": SYNTHETIC_TASKS[instruction](digits)}


def write_synthetic_task(directory: str | Path, num_train: int, num_eval: int, seed: int) -> tuple[Path, Path]:
    """Write `train.jsonl` and `eval.jsonl` (disjoint: no eval prompt occurs in train) and return their paths.

    Deterministic for a seed; existing files with the same parameters are reused.
    """
    directory = Path(directory) / f"digits-{num_train}-{num_eval}-seed{seed}"
    train_path, eval_path = directory / "train.jsonl", directory / "eval.jsonl"
    if train_path.is_file() and eval_path.is_file():
        return train_path, eval_path
    rng = random.Random(seed)
    seen: set[tuple[str, str]] = set()
    rows: list[dict[str, str]] = []
    while len(rows) < num_train + num_eval:
        ex = make_example(rng)
        key = (ex["instruction"], ex["input"])
        if key not in seen:  # keeps the eval split truly held out
            seen.add(key)
            rows.append(ex)
    directory.mkdir(parents=True, exist_ok=True)
    for path, part in ((eval_path, rows[:num_eval]), (train_path, rows[num_eval:])):
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in part))
        tmp.replace(path)
    return train_path, eval_path
