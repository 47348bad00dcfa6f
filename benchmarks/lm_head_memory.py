"""Peak memory and tokens/s of one training step (forward + backward) with a 131,072-token vocabulary, by LM-head loss.

    python benchmarks/lm_head_memory.py [--repeats 3] [--vocab 131072] [--no_write]

The model is a Llama with Llama-3's vocabulary size (untied head) and a small body (2 layers, hidden 256), built
from its config with random weights, float32 on the CPU: the head's logits, not the body, dominate the step's
memory. Every way of computing the loss gets the same packed batch (4 rows of 512 tokens: examples of 64-320
tokens whose first third is an unlabelled prompt, packed as `tunebook.data.packing` does, CPU per-example
attention) and the same token-mean loss:

- tunebook: `causal_lm_token_losses`, as the recipes call it (the loss fused into the head at the loss positions,
  computed in chunks: `tunebook.models.linear_ce`);
- selected: the head at the loss positions only, then `F.cross_entropy` on those logits (Tunebook before the
  fused loss: `output_layer_at` without targets);
- trainer: `model(**inputs, labels=labels).loss`, the full-logits loss transformers' Trainer takes in
  `compute_loss`.

Each way runs in processes of its own, one per repeat, in turn (so one's freed memory cannot hide another's
peak, and load from other work on the machine falls on all of them alike), with glibc's mmap threshold fixed so
that freed tensors leave the resident set. Peak = the highest resident set during the timed step (VmHWM, reset
through /proc/self/clear_refs) minus the resident set before it, after a warm-up step whose gradients are
dropped; so it includes the step's own gradients. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from results import header, write_section

ROOT = Path(__file__).resolve().parents[1]
WAYS = {
    "tunebook": "Tunebook now: loss fused into the head, chunked",
    "selected": "Tunebook before: head at the loss positions, `F.cross_entropy`",
    "trainer": "transformers Trainer: full logits, `model(..., labels=labels).loss`",
}
ROWS, ROW_LENGTH = 4, 512


def model_config(vocab: int) -> dict:
    return {"model_type": "llama", "vocab_size": vocab, "hidden_size": 256, "intermediate_size": 1024,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "max_position_embeddings": ROW_LENGTH, "tie_word_embeddings": False}  # fmt: skip


def packed_batch(vocab: int) -> dict:
    """ROWS rows of examples packed up to ROW_LENGTH tokens, prompts unlabelled, each example's first label masked."""
    import torch

    from tunebook.data import PackedCollator

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(ROWS):
        ids, labels, lengths = [], [], []
        while ROW_LENGTH - len(ids) >= 64:  # the last example takes what is left of the row
            n = min(int(torch.randint(64, 321, (), generator=g)), ROW_LENGTH - len(ids))
            example = torch.randint(0, vocab, (n,), generator=g).tolist()
            prompt = n // 3
            ids += example
            labels += [-100] * prompt + example[prompt:]
            lengths.append(n)
        rows.append({"input_ids": ids, "labels": labels, "seq_lengths": lengths})
    return PackedCollator(pad_token_id=0, pad_to_multiple_of=8)(rows)


def worker(way: str, vocab: int, steps: int) -> dict:
    """Build the model and batch, warm up, then time `steps` forward+backward steps and measure each one's peak."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunebook.data import attention_inputs, use_packed_attention
    from tunebook.training import causal_lm_token_losses, output_layer_at

    torch.manual_seed(0)
    config = model_config(vocab)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).train()
    attn = use_packed_attention(model, "cpu")
    batch = packed_batch(vocab)
    inputs = attention_inputs(batch, attn, torch.float32)
    loss_tokens = batch["loss_targets"].numel()

    def step() -> float:
        if way == "tunebook":
            loss = causal_lm_token_losses(model, inputs, batch)[0].sum() / loss_tokens
        elif way == "selected":
            with output_layer_at(model, batch["loss_positions"]):
                logits = model(**inputs).logits
            loss = F.cross_entropy(logits.float(), batch["loss_targets"], reduction="sum") / loss_tokens
        else:
            loss = model(**inputs, labels=batch["labels"]).loss
        loss.backward()
        return loss.item()

    step()
    model.zero_grad(set_to_none=True)
    times, peaks = [], []
    for _ in range(steps):
        before = _status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
        peaks.append(_status_bytes("VmHWM") - before)
        model.zero_grad(set_to_none=True)
    return {
        "way": way,
        "loss": loss,
        "times": times,
        "peaks": peaks,
        "tokens": int(batch["attention_mask"].sum()),
        "loss_tokens": loss_tokens,
        "threads": torch.get_num_threads(),
    }


def _status_bytes(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
    return int(line.split()[1]) * 1024


def run_worker(way: str, vocab: int, steps: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, __file__, "--worker", way, "--vocab", str(vocab), "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"{way} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="processes per way, run in turn")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per process")
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--no_write", action="store_true")
    parser.add_argument("--worker", choices=list(WAYS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.vocab, args.steps)))
        return

    results = {way: [] for way in WAYS}
    for repeat in range(args.repeats):
        for way in WAYS:
            results[way].append(run_worker(way, args.vocab, args.steps))
            print(repeat, way, json.dumps(results[way][-1]), flush=True)
    first = results["tunebook"][0]
    positions, tokens = first["loss_tokens"], first["tokens"]
    logits_mib = ROWS * ROW_LENGTH * args.vocab * 4 / 2**20
    cfg = model_config(args.vocab)
    lines = [
        *header("LM-head loss memory: fused chunked cross-entropy vs logits (benchmarks/lm_head_memory.py)"),
        f"- Model: Llama, vocabulary {args.vocab:,} (untied head), {cfg['num_hidden_layers']} layers, hidden "
        f"{cfg['hidden_size']}, random weights from config, float32, CPU ({first['threads']} threads). Batch: "
        f"{ROWS} packed rows of {ROW_LENGTH} tokens, {tokens:,} real tokens, {positions:,} with a loss (prompts "
        f"unlabelled). Their logits would take {positions * args.vocab * 4 / 2**20:,.0f} MiB at the loss positions, "
        f"{logits_mib:,.0f} MiB at every position (float32).",
        "- One training step = forward + backward (no optimizer step). Peak: resident-set growth during the step "
        "above the resident set before it (its own gradients included). Medians over "
        f"{args.repeats} processes x {args.steps} steps per way, the ways run in turn.",
        "- **Memory is the headline; tokens/s is indicative**: the machine's 2 cores were shared with other work "
        "while this ran.",
        "",
        "| loss computed by | peak memory of the step (MiB) | step (s) | tokens/s | loss value |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for way, label in WAYS.items():
        times = [t for r in results[way] for t in r["times"]]
        peaks = [p for r in results[way] for p in r["peaks"]]
        step = statistics.median(times)
        lines.append(
            f"| {label} | {statistics.median(peaks) / 2**20:,.0f} | {step:.2f} | {tokens / step:,.0f} "
            f"| {results[way][0]['loss']:.6f} |"
        )
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("lm_head_memory", text)


if __name__ == "__main__":
    main()
