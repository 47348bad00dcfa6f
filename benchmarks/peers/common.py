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


def shared_training_arguments(args: argparse.Namespace) -> dict:
    """The settings every system runs with, as `TrainingArguments` / `SFTConfig` keywords."""
    return dict(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch,
        learning_rate=args.lr,
        num_train_epochs=1,
        lr_scheduler_type="linear",
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        bf16=args.bf16,
        use_cpu=True,
        seed=42,
        disable_tqdm=True,
    )


def train_and_report(trainer, clock: FirstStepClock, result: str) -> None:
    """Train one epoch, save the model as Tunebook does, and write what vs_peers.py reads."""
    metrics = trainer.train().metrics
    trainer.save_model()
    write_result(
        result,
        tokens=int(sum(len(ids) for ids in trainer.train_dataset["input_ids"])),
        train_seconds=metrics["train_runtime"],
        time_to_first_step=clock.seconds,
        final_train_loss=metrics["train_loss"],
    )
