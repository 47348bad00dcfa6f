"""What the peer scripts share: the chat rendering of an Alpaca record, and a first-step clock."""

from __future__ import annotations

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
