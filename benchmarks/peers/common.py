"""What the peer scripts share: the chat rendering of an Alpaca record, the model, the training settings, and the
clocks and counters behind the figures they report.

The options after `--bf16 ... --cache_dir` serve benchmarks/gpu/gpu_vs_peers.py (fixed steps on a GPU, LoRA, steady-state
tokens/s, peak GPU memory); their defaults keep benchmarks/vs_peers.py's CPU runs as they were.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import time

import psutil
import torch
from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments


def alpaca_messages(record: dict) -> list[dict[str, str]]:
    """The same rendering Tunebook uses: instruction and input as the user turn, output as the assistant's."""
    prompt = record["instruction"] + (f"\n{record['input']}" if record.get("input") else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]


def record_messages(record: dict) -> list[dict[str, str]]:
    """A chat record's `messages` (multi-turn data), or an Alpaca record as one user and one assistant turn."""
    return record["messages"] if record.get("messages") else alpaca_messages(record)


def sft_features(tokenizer, record: dict, max_length: int) -> dict[str, list[int]]:
    """Chat-template token ids of one record, truncated to `max_length`, labels masked (-100) outside the assistant
    turns (each turn's span found by rendering the conversation up to it, as TRL's assistant masks do)."""
    messages = record_messages(record)

    def length(turns, prompt):
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=prompt)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"]
    labels = [-100] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start, end = length(messages[:i], True), length(messages[: i + 1], False)
            labels[start:end] = ids[start:end]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels[: len(ids)]}


class FirstStepClock(TrainerCallback):
    """Seconds from process start to the end of the first optimizer step, as Tunebook's summary reports it."""

    def __init__(self):
        self.seconds = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.seconds is None:
            self.seconds = time.time() - psutil.Process(os.getpid()).create_time()


class PositionCount(TrainerCallback):
    """Positions the model computes, padding included (`input_ids.numel()` of every forward): with the non-padding
    tokens, how much of the work went to padding."""

    def __init__(self):
        self.positions = 0

    def _count(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        self.positions += ids.numel() if ids is not None else 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.register_forward_pre_hook(self._count, with_kwargs=True)


class SteadyClock(TrainerCallback):
    """Non-padding tokens per second from the end of step `warmup` to the end of the last step.

    Tokens are counted where the model is called (the attention mask's ones, or every token of a padding-free row),
    on the device, so counting adds no host sync; the clock synchronises the GPU only at its two readings.
    """

    def __init__(self, warmup: int):
        self.warmup, self.tokens, self.start, self.result = warmup, None, None, None

    def _count(self, module, args, kwargs):
        mask, ids = kwargs.get("attention_mask"), kwargs.get("input_ids")
        if mask is not None and mask.dim() == 2:
            self.tokens += mask.sum()
        elif ids is not None:
            self.tokens += ids.numel()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.tokens = torch.zeros((), dtype=torch.int64, device=args.device)
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _reading(self) -> tuple[float, int]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter(), int(self.tokens.item())

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            self.start = (self._reading(), state.global_step)
        elif state.global_step == state.max_steps and self.start is not None:
            (t0, n0), step0 = self.start
            t1, n1 = self._reading()
            self.result = {"steady_tokens_per_second": (n1 - n0) / (t1 - t0), "steady_steps": state.global_step - step0,
                           "counted_tokens": n1}  # fmt: skip


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
    # --- for benchmarks/gpu/gpu_vs_peers.py
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--max_steps", type=int, default=-1, help="optimizer steps (-1: one epoch)")
    parser.add_argument("--grad_accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default=None, help="weights' dtype (default: as saved)"
    )
    parser.add_argument("--attn_implementation", default="sdpa")
    parser.add_argument("--collator", choices=("pad", "flatten"), default="pad",
                        help="trainer_sft.py: pad to the longest, or DataCollatorWithFlattening (padding-free)")  # fmt: skip
    parser.add_argument("--lora", action="store_true", help="LoRA as Tunebook's defaults: r 16, alpha 32, all linear")
    parser.add_argument("--gradient_checkpointing", choices=("on", "off"), default=None,
                        help="default: the library's (TRL's SFTConfig turns it on, TrainingArguments off)")  # fmt: skip
    parser.add_argument("--logging_steps", type=int, default=10)
    parser.add_argument("--num_workers", type=int, default=0, help="DataLoader workers")
    parser.add_argument("--timing_warmup", type=int, default=0, help="steps before the steady-state clock starts")
    parser.add_argument("--no_save", action="store_true", help="do not save the final model")
    parser.add_argument("--training_args", default="{}", help="JSON of extra TrainingArguments / SFTConfig keys")
    return parser.parse_args()


def load_model(args: argparse.Namespace):
    """The saved model (in `--dtype` if given), with LoRA adapters on every linear layer but the head with `--lora`."""
    dtype = {"dtype": getattr(torch, args.dtype)} if args.dtype else {}
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=args.attn_implementation, **dtype)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    return model


def shared_training_arguments(args: argparse.Namespace) -> dict:
    """The settings every system runs with, as `TrainingArguments` / `SFTConfig` keywords."""
    settings = dict(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch,
        learning_rate=args.lr,
        num_train_epochs=1,
        lr_scheduler_type="linear",
        logging_steps=args.logging_steps,
        save_strategy="no",
        report_to="none",
        bf16=args.bf16,
        use_cpu=args.device == "cpu",
        seed=42,
        disable_tqdm=True,
        max_steps=args.max_steps,  # this and the next two default to TrainingArguments' own defaults
        gradient_accumulation_steps=args.grad_accum,
        dataloader_num_workers=args.num_workers,
    )
    if args.gradient_checkpointing:  # non-reentrant, as Tunebook; transformers 5.2x renamed the argument
        fields = {f.name for f in dataclasses.fields(TrainingArguments)}
        name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
        settings[name] = args.gradient_checkpointing == "on"
        if settings[name]:
            settings[f"{name}_kwargs"] = {"use_reentrant": False}
    return {**settings, **json.loads(args.training_args)}


def callbacks(args: argparse.Namespace) -> list[TrainerCallback]:
    return [FirstStepClock(), PositionCount()] + ([SteadyClock(args.timing_warmup)] if args.max_steps > 0 else [])


def peak_memory(device: str) -> dict:
    """Peak GPU memory of this process (the caching allocator's, allocated and reserved), or its peak RSS on a CPU."""
    if device == "cuda":
        return {"peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20,
                "peak_memory_reserved_mb": torch.cuda.max_memory_reserved() / 2**20,
                "device_name": torch.cuda.get_device_name()}  # fmt: skip
    return {"peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "device_name": "cpu"}


def train_and_report(trainer, clocks: list[TrainerCallback], args: argparse.Namespace) -> None:
    """Train, save the model as Tunebook does (unless --no_save), and write what vs_peers.py and gpu_vs_peers.py
    read. `clocks` are `callbacks(args)`, as passed to the trainer."""
    metrics = trainer.train().metrics
    if not args.no_save:
        trainer.save_model()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    first_step, positions = (
        next(c for c in clocks if isinstance(c, kind)) for kind in (FirstStepClock, PositionCount)
    )
    steady = next((c.result for c in clocks if isinstance(c, SteadyClock) and c.result), {})
    write_result(
        args.result,
        tokens=int(sum(len(ids) for ids in trainer.train_dataset["input_ids"])),
        train_seconds=metrics["train_runtime"],
        time_to_first_step=first_step.seconds,
        final_train_loss=metrics["train_loss"],  # the mean over all steps
        last_logged_loss=losses[-1] if losses else None,  # the mean over the last logging window
        steps=trainer.state.global_step,
        computed_positions=positions.positions,
        **peak_memory(args.device),
        **steady,
    )
