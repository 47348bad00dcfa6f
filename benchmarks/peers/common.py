"""What the peer scripts share: the chat rendering of an Alpaca record, and a first-step clock."""

from __future__ import annotations

import argparse
import json
import os
import time

import psutil
from transformers import TrainerCallback


def alpaca_messages(record: dict) -> list[dict[str, str]]:
    """The same rendering Tunebook uses: instruction and input as the user turn, output as the assistant's."""
    prompt = record["instruction"] + (f"\n{record['input']}" if record.get("input") else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]


class FirstStepClock(TrainerCallback):
    """Seconds from process start to the end of the first optimizer step, as Tunebook's summary reports it."""

    def __init__(self):
        self.seconds = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.seconds is None:
            self.seconds = time.time() - psutil.Process(os.getpid()).create_time()


def write_result(path: str, **values) -> None:
    with open(path, "w") as f:
        json.dump(values, f, indent=2)


def parse_args() -> argparse.Namespace:
    """The arguments both peer scripts take: DATA MODEL_DIR OUT_DIR RESULT [--bf16] [--batch] [--lr] ..."""
    parser = argparse.ArgumentParser()
    for name in ("data", "model", "output_dir", "result"):
        parser.add_argument(name)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--cache_dir", default=None)
    return parser.parse_args()
