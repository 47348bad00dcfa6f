"""Tunebook vs the transformers Trainer vs TRL on one GPU: tokens/s, MFU, peak memory and final loss (issue 17).

    python benchmarks/gpu/gpu_vs_peers.py            # every run (an estimated 20-25 minutes on an H100); RESULTS.md
    python benchmarks/gpu/gpu_vs_peers.py --smoke    # tiny shapes, a few steps, on the CPU: every code path, no RESULTS.md

Each system runs in its own process (a fresh CUDA context, so peak memory is each system's own) on the same saved
weights, tokenizer and data, for the same optimizer steps of about the same tokens, bf16 autocast over float32
weights (LoRA: a bfloat16 frozen base), AdamW at learning rate 3e-4, linear decay, no warmup, seed 42:

- tunebook: recipes/sft.py through `accelerate launch` (single_gpu.yaml), packing into rows of L tokens with
  attention kept inside each example; `--tunebook_args "--key value ..."` adds overrides (torch_compile, ...);
- trainer_pad: transformers `Trainer`, prompt-masked, padding to the longest of each micro-batch
  (benchmarks/peers/trainer_sft.py); its micro-batches pad to about the packed rows' size (examples per micro-batch
  = tokens per micro-batch / the 95th-percentile example length) and gradient accumulation makes up the step;
- trainer_flat: the same `Trainer` with `DataCollatorWithFlattening` (padding-free: one row per micro-batch whose
  position ids restart at each example; SDPA gets the block-diagonal mask transformers 5 builds from them);
- trl: TRL `SFTTrainer` with packing ('bfd', padding-free) on prompt/completion data (benchmarks/peers/trl_sft.py).

Models, built from their configs with random weights (throughput does not depend on the values, and nothing is
downloaded) and saved once in the work directory: SmolLM2-135M and Llama-3.2-1B shapes trained in full at rows of
2048 and 4096 tokens, and Llama-3.1-8B with LoRA (r 16, all linear layers, gradient checkpointing) at 2048, skipped
when the disk or the GPU is too small (--lora_8b). The tokenizer is a byte-level BPE trained here on the data (or
--tokenizer DIR); the models keep their real vocabulary sizes, so the embeddings and the LM head cost what they cost
in the real models, and the tokenizer's ids simply stay below them. Data: Code Alpaca (--train_data).

Figures: tokens/s = non-padding tokens per second from the end of step --timing_warmup to the last step (start-up,
compilation and warm-up excluded); MFU = FLOPs per token x tokens/s / the data-sheet dense bf16 peak, the FLOPs by
tunebook.planning.flops (6 x linear multiply-accumulates + attention within each example; the LM head for the
loss-bearing tokens only, as every system needs no more; LoRA: 4 x for the frozen weights, which get no weight
gradients; recomputation not counted); peak memory = torch.cuda.max_memory_allocated in each process; final loss =
the mean over the last logging window. Goals (issue 17): for the Llama-3.2-1B shape, MFU >= 45% and >= 1.5x the
faster Trainer's tokens/s at equal or lower peak memory.

Every run appends to WORK_DIR/runs.jsonl, and a later call skips the runs found there (--fresh starts over). Where
one command may only run for minutes, run a part per command (--shapes) with --out DIR, which gets runs.jsonl and
the table instead of RESULTS.md; `--record FILE ...` then writes the section from runs.jsonl files brought back.

`--no_cudnn_attention` runs every system's processes with PyTorch's cuDNN attention kernel turned off (through a
`sitecustomize` on their path; rows of their own): on an H100 SDPA with a mask takes cuDNN's kernel first, the one
whose results the compiled blocks' different loss (RESULTS.md) may come from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# results.py (the machine, versions, RESULTS.md sections) is shared with the CPU benchmarks one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from results import command, machine, versions, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "benchmarks" / "peers"
LLAMA = {"model_type": "llama", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}
SMOLLM2_135M = {**LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
                "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}  # fmt: skip
LLAMA_32_1B = {**LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True,
               "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}  # fmt: skip
LLAMA_31_8B = {**LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
               "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}  # fmt: skip
TINY = {**LLAMA, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 4096, "tie_word_embeddings": True}  # fmt: skip


@dataclasses.dataclass
class Shape:
    config: dict
    micro_tokens: int  # tokens per micro-batch (rows x L for the packed systems)
    accumulation: int  # micro-batches per optimizer step
    lora: bool = False  # LoRA on a bfloat16 base with gradient checkpointing, at the first row length only


SHAPES = {
    "SmolLM2-135M": Shape(SMOLLM2_135M, 16384, 1),
    "Llama-3.2-1B": Shape(LLAMA_32_1B, 8192, 2),
    "Llama-3.1-8B LoRA": Shape(LLAMA_31_8B, 4096, 4, lora=True),
}
SMOKE_SHAPES = {
    "tiny": Shape(TINY, 512, 2),
    "tiny LoRA": Shape({**TINY, "tie_word_embeddings": False}, 512, 2, lora=True),
}
SYSTEMS = {
    "tunebook": "Tunebook SFT, packing",
    "trainer_pad": "Trainer, padding to longest",
    "trainer_flat": "Trainer, DataCollatorWithFlattening",
    "trl": "TRL SFTTrainer, packing (bfd, padding-free)",
}
GOAL_MFU, GOAL_SPEEDUP = 0.45, 1.5


# --- preparation: the environment (in a throwaway process, so this one never holds a CUDA context), data, models
def in_own_process(function, *args):
    """`function(*args)` in a new process that ends with it: the GPU memory it took is free for the runs."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def environment(cuda: bool) -> dict:
    import torch

    found = {"machine": machine(), "versions": versions("trl", "peft"), "device": "cpu", "memory_gib": 0.0}
    if cuda and torch.cuda.is_available():
        found.update(device=torch.cuda.get_device_name(), memory_gib=torch.cuda.mem_get_info()[1] / 2**30)
    return found


def build_model(path: Path, values: dict, tokenizer_dir: Path, dtype: str, device: str) -> None:
    """A model of `values`' shape with random weights, saved with the tokenizer (once: kept for later calls)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (path / "config.json").is_file():
        return
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    values = dict(values)
    config = AutoConfig.for_model(values.pop("model_type"), **values, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):  # random init of an 8B model on the GPU takes seconds, on the CPU minutes
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(path)  # complete or absent: an interrupted save is never loaded


def prepare_data(work: Path, source: Path, examples: int, tokenizer: str | None, vocab_size: int) -> tuple[Path, Path]:
    """The data subset every system reads, and the tokenizer: the one given, else a BPE trained on the data."""
    sys.path.insert(0, str(ROOT / "src"))
    records = json.loads(source.read_text())[:examples]
    data = work / "train.json"
    data.write_text(json.dumps(records))
    if tokenizer:
        return data, Path(tokenizer)
    tokenizer_dir = work / f"tokenizer-{vocab_size}"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        from tunebook.data.formats import to_conversations
        from tunebook.models import train_chat_tokenizer

        batch = {k: [r.get(k, "") for r in records] for k in ("instruction", "input", "output")}
        texts = [f"{m['role']}\n{m['content']}"
                 for row in to_conversations(batch, data_format="alpaca", where="")["conversation"]
                 for m in json.loads(row)["messages"]]  # fmt: skip
        train_chat_tokenizer(texts, vocab_size=vocab_size).save_pretrained(tokenizer_dir)
    return data, tokenizer_dir


def data_shape(data: Path, tokenizer_dir: Path, max_length: int) -> dict:
    """Example lengths as every system tokenises them: mean, 95th percentile, attention span, loss-bearing share."""
    import numpy as np
    from transformers import AutoTokenizer

    from tunebook.planning.flops import attention_span

    sys.path.insert(0, str(PEERS))
    from common import sft_features

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    features = [sft_features(tokenizer, r, max_length) for r in json.loads(data.read_text())]
    lengths = np.array([len(f["input_ids"]) for f in features])
    labelled = sum(sum(t != -100 for t in f["labels"]) for f in features)
    return {"mean": float(lengths.mean()), "p95": float(np.percentile(lengths, 95)),
            "span": attention_span(lengths), "label_fraction": labelled / lengths.sum()}  # fmt: skip


def flops_per_token(values: dict, stats: dict, lora: bool) -> float:
    """Training FLOPs per token by tunebook.planning.flops, on a model built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunebook.planning.flops import model_flops_per_token

    values = dict(values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))
    flops = model_flops_per_token(model, stats["span"], stats["label_fraction"])
    if lora:  # frozen weights: forward and input gradients (4x), no weight gradients (the other 2x of 6x)
        flops -= model_flops_per_token(model, 0.0, stats["label_fraction"]) / 3
    return flops


def tunebook_overrides(text: str) -> list[str]:
    """`--tunebook_args`, less the keys this checkout's SFTConfig does not have (with a warning, not a failure)."""
    from tunebook.config import SFTConfig

    known = {f.name for f in dataclasses.fields(SFTConfig)}
    words, kept, i = shlex.split(text), [], 0
    while i < len(words):
        key, _, value = words[i].removeprefix("--").partition("=")
        pair = [words[i]] if value else words[i : i + 2]
        i += len(pair)
        if key in known:
            kept += pair
        else:
            print(f"warning: --tunebook_args: recipes/sft.py has no key '{key}' here; dropped", flush=True)
    return kept


# --- one run: a system on a shape at a row length, in its own process
def plan_run(name: str, shape: Shape, seq_len: int, stats: dict) -> dict:
    """Micro-batches of about `shape.micro_tokens` tokens for every system, and the same steps and examples."""
    rows = max(1, shape.micro_tokens // seq_len)
    micro_examples = max(1, round(rows * seq_len / stats["mean"]))  # padding-free: the packed rows' tokens
    pad_examples = max(1, math.floor(rows * seq_len / stats["p95"]))  # padded: rarely much over the rows' size
    return {"shape": name, "seq_len": seq_len, "lora": shape.lora, "rows": rows, "accumulation": shape.accumulation,
            "micro_examples": micro_examples, "pad_examples": pad_examples,
            "pad_accumulation": max(1, round(micro_examples * shape.accumulation / pad_examples)),
            "flops_per_token": flops_per_token(shape.config, stats, shape.lora)}  # fmt: skip


def halve(system: str, run: dict) -> dict | None:
    """`run` with half the micro-batch of `system` and twice the accumulation (the same tokens per step), or None
    where its micro-batch is already one row or one example."""
    size, steps = {"trainer_pad": ("pad_examples", "pad_accumulation"),
                   "trainer_flat": ("micro_examples", "accumulation")}.get(system, ("rows", "accumulation"))  # fmt: skip
    if run[size] < 2:
        return None
    return {**run, size: run[size] // 2, steps: run[steps] * 2}


def system_command(system: str, run: dict, args, paths: dict, out: Path, result: Path) -> list[str]:
    cuda, seq_len, rows = not args.smoke, run["seq_len"], run["rows"]
    if system == "tunebook":
        return [sys.executable, "-m", "accelerate.commands.launch", "--quiet", "--num_processes", "1",
                "--config_file", str(ROOT / "accelerate_configs" / ("single_gpu.yaml" if cuda else "cpu.yaml")),
                "--mixed_precision", "bf16" if cuda else "no", str(ROOT / "recipes" / "sft.py"),
                "--model_name_or_path", str(paths["model"]), "--train_data", str(paths["data"]), "--packing", "true",
                "--max_seq_length", str(seq_len), "--per_device_train_batch_size", str(rows),
                "--gradient_accumulation_steps", str(run["accumulation"]), "--max_steps", str(args.max_steps),
                "--learning_rate", str(args.lr), "--lr_scheduler_type", "linear", "--warmup_ratio", "0",
                "--eval_split_ratio", "0", "--eval_on_start", "false", "--generation_eval", "false",
                "--save_strategy", "no", "--report_to", "none", "--logging_steps", str(args.logging_steps),
                "--disable_tqdm", "true", "--dataloader_num_workers", str(args.num_workers),
                "--gradient_checkpointing", str(run["lora"]).lower(), "--use_peft", str(run["lora"]).lower(),
                "--cache_dir", str(paths["work"] / "cache"), "--output_dir", str(out), *paths["tunebook_args"]]  # fmt: skip
    script, batch, accumulation = {
        "trainer_pad": ("trainer_sft.py", run["pad_examples"], run["pad_accumulation"]),
        "trainer_flat": ("trainer_sft.py", run["micro_examples"], run["accumulation"]),
        "trl": ("trl_sft.py", rows, run["accumulation"]),
    }[system]
    return [sys.executable, str(PEERS / script), str(paths["data"]), str(paths["model"]), str(out), str(result),
            "--batch", str(batch), "--grad_accum", str(accumulation), "--max_steps", str(args.max_steps),
            "--lr", str(args.lr), "--max_length", str(seq_len), "--cache_dir", str(paths["work"] / "cache" / "hf"),
            "--device", "cuda" if cuda else "cpu", "--dtype", "bfloat16" if run["lora"] else "float32",
            "--collator", "flatten" if system == "trainer_flat" else "pad",
            "--logging_steps", str(args.logging_steps), "--timing_warmup", str(args.timing_warmup),
            "--num_workers", str(args.num_workers), "--no_save", "--training_args", args.peer_training_args,
            "--gradient_checkpointing", "on" if run["lora"] else "off",  # TRL's default is on: the same for all
            *(["--bf16"] if cuda else []), *(["--lora"] if run["lora"] else [])]  # fmt: skip


def run_one(system: str, run: dict, args, paths: dict, env: dict) -> dict:
    """One system's process; its figures, or status "oom" / "failed" (the log stays in the work directory)."""
    name = f"{run['shape']}-{run['seq_len']}-{system}".replace(" ", "_")
    out, result, log = paths["work"] / "out" / name, paths["work"] / f"{name}.json", paths["work"] / f"{name}.log"
    shutil.rmtree(out, ignore_errors=True)
    result.unlink(missing_ok=True)
    cmd = system_command(system, run, args, paths, out, result)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - start
    log.write_text(shlex.join(cmd) + "\n\n" + done.stdout)
    packed = f"{run['rows']} row{'s' if run['rows'] > 1 else ''} x {run['accumulation']}"
    per_step = {"tunebook": packed, "trl": packed,
                "trainer_flat": f"{run['micro_examples']} examples x {run['accumulation']}",
                "trainer_pad": f"{run['pad_examples']} examples x {run['pad_accumulation']}"}[system]  # fmt: skip
    record = {**{k: run[k] for k in ("shape", "seq_len", "lora", "flops_per_token")}, "system": system,
              "micro_batches": per_step, "wall_seconds": wall, "device": paths["device"], "machine": paths["machine"],
              "versions": paths["versions"], "command": command(),
              "tunebook_args": shlex.join(paths["tunebook_args"]), "peer_training_args": args.peer_training_args,
              **paths["sdpa"]}  # fmt: skip
    if done.returncode != 0:
        oom = "out of memory" in done.stdout.lower()
        print(f"{name}: {'out of memory' if oom else 'FAILED'} (log: {log})\n{done.stdout[-3000:]}", flush=True)
        return {**record, "status": "oom" if oom else "failed"}
    if system == "tunebook":
        figures = tunebook_figures(out, args.timing_warmup)
    else:
        r = json.loads(result.read_text())
        figures = {"tokens_per_second": r["steady_tokens_per_second"], "tokens_per_step": r["counted_tokens"] /
                   r["steps"], "peak_memory_mb": r["peak_memory_mb"], "final_loss": r["last_logged_loss"]}  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)  # a 1B model in float32 is 5 GB; the figures are what is kept
    peak = args.peak_flops or peak_flops(paths["device"])
    utilisation = run["flops_per_token"] * figures["tokens_per_second"] / peak if peak else None
    return {**record, "status": "ok", **figures, "mfu": utilisation}


def tunebook_figures(out: Path, warmup: int) -> dict:
    """Steady tokens/s from the logging windows of metrics.jsonl after step `warmup`, as the peers' clock counts."""
    summary = json.loads((out / "summary.json").read_text())
    windows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = [w for w in windows if "tokens_per_second" in w]
    at_warmup = next(w["train_tokens"] for w in windows if w["step"] == warmup)
    seconds, tokens = 0.0, at_warmup
    for w in (w for w in windows if w["step"] > warmup):
        seconds += (w["train_tokens"] - tokens) / w["tokens_per_second"]
        tokens = w["train_tokens"]
    peak = summary.get("peak_device_memory_mb") or summary["peak_rss_mb"]
    return {"tokens_per_second": (tokens - at_warmup) / seconds, "peak_memory_mb": peak,
            "tokens_per_step": summary["train_tokens"] / summary["train_steps"],
            "final_loss": summary["final_train_loss"],
            # kept to tell a slow run's cause later: windows' speeds, recompiles, the loader's waits; and the windows'
            # losses, to tell where two runs' losses part (compiled and eager 1B runs ended 0.15 apart)
            "windows_tokens_per_second": [w["tokens_per_second"] for w in windows],
            "windows_loss": [[w["step"], w.get("loss")] for w in windows],
            **{k: v for k, v in summary.items() if k.startswith(DIAGNOSTICS)}}  # fmt: skip


DIAGNOSTICS = ("torch_compile_", "first_batch_wait", "data_wait", "time_to_first_step")  # summary.json keys kept


def peak_flops(device: str) -> float | None:
    from tunebook.planning.flops import PEAK_FLOPS

    return next((flops for key, flops in PEAK_FLOPS.items() if key in device), None)


# --- the table
def table(records: list[dict]) -> str:
    # A repeated run: its last record; Tunebook runs with other overrides are rows of their own.
    latest = {(r["shape"], r["seq_len"], system_key(r)): r for r in records}
    first = next(iter(latest.values()))
    peak = peak_flops(first["device"])
    lines = [
        "## Tunebook vs transformers Trainer vs TRL on one GPU, bf16 (benchmarks/gpu/gpu_vs_peers.py)",
        "",
        f"- Machine: {first['machine']}",
        f"- Versions: {first['versions']}",
        *[f"- Command: `{c}`" for c in dict.fromkeys(r["command"] for r in latest.values())],
        "- Setup: each model built from the config of the model it is named after, with random weights (its real "
        "vocabulary size; a BPE tokenizer trained on the data), Code Alpaca, the same steps of about the same "
        "tokens for every system (micro-batch x accumulation steps below), bf16 autocast over float32 weights (LoRA r 16 on a bfloat16 base with gradient "
        "checkpointing), AdamW 3e-4 linear, each system in its own process. Tokens/s counts non-padding tokens "
        "after the warm-up steps; MFU against the data-sheet dense bf16 peak"
        + (f" ({peak / 1e12:.0f} TFLOP/s)" if peak else "")
        + " with the FLOPs of tunebook.planning.flops (LM head for loss-bearing tokens only, LoRA without frozen "
        "weight gradients); peak memory is `torch.cuda.max_memory_allocated` of each process.",
    ]
    extra = {f"peer TrainingArguments `{r['peer_training_args']}`" for r in latest.values()
              if r["peer_training_args"] != "{}"}  # fmt: skip
    if extra:
        lines.append("- Extra settings: " + "; ".join(sorted(extra)) + ".")
    groups = dict.fromkeys((r["shape"], r["seq_len"]) for r in latest.values())
    for shape, seq_len in groups:
        rows = {k: r for (sh, n, k), r in sorted(latest.items(), key=lambda i: list(SYSTEMS).index(i[1]["system"]))
                if (sh, n) == (shape, seq_len)}  # fmt: skip
        lines += ["", f"### {shape}, rows of {seq_len}", "",
                  "| system | micro-batch x steps | tokens/step | tokens/s | MFU | peak memory (GiB) | final loss | wall (s) |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for r in rows.values():
            label = system_label(r)
            if r["status"] != "ok":
                failure = "out of memory" if r["status"] == "oom" else "failed"
                lines.append(f"| {label} | {r['micro_batches']} | {failure} | – | – | – | – "
                             f"| {r['wall_seconds']:.0f} |")  # fmt: skip
                continue
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "–"
            loss = f"{r['final_loss']:.3f}" if r["final_loss"] is not None else "–"
            lines.append(f"| {label} | {r['micro_batches']} | {r['tokens_per_step']:,.0f} | {r['tokens_per_second']:,.0f} | {mfu} "
                         f"| {r['peak_memory_mb'] / 1024:.2f} | {loss} | {r['wall_seconds']:.0f} |")  # fmt: skip
        lines += ["", goals(shape, rows)]
    return "\n".join(lines)


NO_CUDNN = "no cuDNN attention"  # the `sdpa` of runs with --no_cudnn_attention


def _overrides(record: dict) -> str:
    return record.get("tunebook_args", "") if record["system"] == "tunebook" else ""


def system_key(record: dict) -> str:
    """The table row of a run: its system, for Tunebook the overrides it ran with, and the SDPA kernels left out."""
    key = f"tunebook {_overrides(record)}" if _overrides(record) else record["system"]
    return f"{key} ({record['sdpa']})" if record.get("sdpa") else key


def system_label(record: dict) -> str:
    args = _overrides(record)
    return SYSTEMS[record["system"]] + (f" + `{args}`" if args else "") + (
        f", {record['sdpa']}" if record.get("sdpa") else "")  # fmt: skip


def goals(shape: str, rows: dict) -> str:
    """Tunebook (each of its rows) against the faster of the two Trainer runs (and TRL), and the MFU goal for the 1B
    shape."""
    ours = [r for r in rows.values() if r["system"] == "tunebook"]
    if not ours:
        return "Goals: not measured (no Tunebook run)."
    return "\n\n".join(tunebook_goals(shape, r, rows) for r in ours)


def tunebook_goals(shape: str, ours: dict, rows: dict) -> str:
    name = system_label(ours).replace(SYSTEMS["tunebook"], "Tunebook")
    if ours["status"] != "ok":
        return f"{name}: not measured (the run did not finish)."
    # each peer as it ran with the same SDPA kernels as this row where it did, else as it ran by default
    peers = {r["system"]: r for r in rows.values() if r["system"] != "tunebook" and not r.get("sdpa")}
    peers.update(
        {r["system"]: r for r in rows.values() if r["system"] != "tunebook" and r.get("sdpa") == ours.get("sdpa")}
    )
    rows = peers
    trainers = [rows[s] for s in ("trainer_pad", "trainer_flat") if s in rows and rows[s]["status"] == "ok"]
    parts = []
    if trainers:
        best = max(trainers, key=lambda r: r["tokens_per_second"])
        speedup = ours["tokens_per_second"] / best["tokens_per_second"]
        memory_ok = ours["peak_memory_mb"] <= best["peak_memory_mb"]
        met = speedup >= GOAL_SPEEDUP and memory_ok
        parts.append(f"{speedup:.2f}x the tokens/s of the faster Trainer ({SYSTEMS[best['system']]}) at "
                     f"{ours['peak_memory_mb'] / 1024:.1f} vs {best['peak_memory_mb'] / 1024:.1f} GiB "
                     f"(goal >= {GOAL_SPEEDUP}x at equal or lower memory: {'met' if met else 'not met'})")  # fmt: skip
    elif any(s in rows for s in ("trainer_pad", "trainer_flat")):
        parts.append("both Trainer runs ran out of memory or failed")
    if "trl" in rows and rows["trl"]["status"] == "ok":
        parts.append(f"{ours['tokens_per_second'] / rows['trl']['tokens_per_second']:.2f}x TRL's tokens/s")
    if ours["mfu"] is not None:
        goal = f" (goal >= {GOAL_MFU:.0%}: {'met' if ours['mfu'] >= GOAL_MFU else 'not met'})" if "1B" in shape else ""
        parts.append(f"MFU {100 * ours['mfu']:.1f}%{goal}")
    return f"{name}: " + ("; ".join(parts) or "no peer run and no MFU (no known peak) to compare with") + "."


# --- main: what to run, preparation, the runs (skipping those already in runs.jsonl), the table
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 6 steps, CPU; prints the table only")
    parser.add_argument("--shapes", default=None, help=f"a comma-separated subset of: {', '.join(SHAPES)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="a comma-separated subset")
    parser.add_argument("--seq_lens", default="2048,4096", help="row lengths of the full fine-tuning runs")
    parser.add_argument("--lora_8b", choices=("auto", "on", "off"), default="auto",
                        help="auto: skip the 8B LoRA runs with less than 24 GiB of free disk or 40 GiB of GPU memory")  # fmt: skip
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--timing_warmup", type=int, default=10, help="steps before tokens/s is measured")
    parser.add_argument("--logging_steps", type=int, default=10, help="must divide --timing_warmup and --max_steps")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--num_workers", type=int, default=4, help="DataLoader workers of every system")
    parser.add_argument("--train_data", default=str(ROOT.parent / "shared/data/code_alpaca_2k/code_alpaca_2k.json"))
    parser.add_argument("--examples", type=int, default=None, help="the first N examples (default: all)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: train a BPE on the data)")
    parser.add_argument("--tokenizer_vocab_size", type=int, default=8192)
    parser.add_argument("--tunebook_args", default="", help='extra recipe overrides, e.g. "--torch_compile true"')
    parser.add_argument("--peer_training_args", default="{}", help="JSON of extra TrainingArguments for the peers")
    parser.add_argument("--no_cudnn_attention", action="store_true", help="turn off PyTorch's cuDNN SDPA kernel")
    parser.add_argument("--peak_flops", type=float, default=None, help="override the data-sheet peak FLOP/s")
    parser.add_argument("--work_dir", default=None, help="default /tmp/tunebook-gpu-vs-peers[-smoke]")
    parser.add_argument("--fresh", action="store_true", help="ignore the runs already in WORK_DIR/runs.jsonl")
    parser.add_argument("--out", default=None, help="also write runs.jsonl and gpu_vs_peers.md here")
    parser.add_argument("--no_write", action="store_true", help="do not write RESULTS.md")
    parser.add_argument("--record", nargs="+", default=None, help="write the section from these runs.jsonl files")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    if args.record:
        records = [json.loads(line) for f in args.record for line in Path(f).read_text().splitlines() if line]
        text = table(records)
        print(text)
        if not args.no_write:
            write_section("gpu_vs_peers", text)
        return
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    chosen = args.shapes.split(",") if args.shapes else list(shapes)
    systems = args.systems.split(",")
    if unknown := [s for s in chosen if s not in shapes] + [s for s in systems if s not in SYSTEMS]:
        parser.error(f"unknown shape or system {unknown}: shapes {list(shapes)}, systems {list(SYSTEMS)}")
    if args.smoke:
        args.max_steps, args.timing_warmup, args.logging_steps, args.num_workers = 6, 2, 2, 1
        args.seq_lens, args.examples, args.tokenizer_vocab_size = "256,512", args.examples or 200, 2048
    if args.timing_warmup % args.logging_steps or args.max_steps % args.logging_steps:
        parser.error("--logging_steps must divide --timing_warmup and --max_steps (Tunebook's windows are timed)")
    if not 0 < args.timing_warmup < args.max_steps:
        parser.error("--timing_warmup: at least one step, and fewer than --max_steps")
    work = Path(args.work_dir or ("/tmp/tunebook-gpu-vs-peers" + ("-smoke" if args.smoke else "")))
    if args.fresh or args.smoke:
        (work / "runs.jsonl").unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)

    found = in_own_process(environment, not args.smoke)
    if not args.smoke and found["device"] == "cpu":
        sys.exit("gpu_vs_peers.py needs a CUDA GPU (--smoke runs tiny shapes on the CPU)")
    missing = [m for m in ("datasets", "peft", "trl") if not importable(m)]
    if missing:
        sys.exit(f"missing packages: {', '.join(missing)} (pip install -e '.[bench]', or carry their wheels)")
    data, tokenizer_dir = prepare_data(work, Path(args.train_data), args.examples, args.tokenizer,
                                       args.tokenizer_vocab_size)  # fmt: skip
    paths = {"work": work, "data": data, **found, "tunebook_args": tunebook_overrides(args.tunebook_args),
             "sdpa": {"sdpa": NO_CUDNN} if args.no_cudnn_attention else {}}  # fmt: skip
    overrides = shlex.join(paths["tunebook_args"])
    paths_first = [str(ROOT / "src")]
    if args.no_cudnn_attention:  # every process a system starts (accelerate launch's too) reads it as it starts
        site = work / "no_cudnn_attention"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text("import torch\n\ntorch.backends.cuda.enable_cudnn_sdp(False)\n")
        paths_first.append(str(site))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([*paths_first, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           **({"OMP_NUM_THREADS": "1"} if args.smoke else {})}  # fmt: skip

    done = [json.loads(line) for line in (work / "runs.jsonl").read_text().splitlines()] if (
        work / "runs.jsonl").is_file() else []  # fmt: skip
    have = {(r["shape"], r["seq_len"], system_key(r)) for r in done if r["status"] != "failed"}  # an OOM stays one
    seq_lens = [int(n) for n in args.seq_lens.split(",")]
    stats = {n: data_shape(data, tokenizer_dir, n) for n in seq_lens}
    for shape_name in chosen:
        shape = shapes[shape_name]
        if shape.lora and not args.smoke and not lora_fits(args.lora_8b, work, found["memory_gib"]):
            continue
        dtype = "bfloat16" if shape.lora else "float32"
        model = work / "models" / f"{shape_name.replace(' ', '_')}-{dtype}-{tokenizer_dir.name}"
        in_own_process(build_model, model, shape.config, tokenizer_dir, dtype, "cpu" if args.smoke else "cuda")
        for seq_len in seq_lens[:1] if shape.lora else seq_lens:
            run = plan_run(shape_name, shape, seq_len, stats[seq_len])
            for system in (s for s in SYSTEMS if s in systems):
                planned = {"system": system, "tunebook_args": overrides, **paths["sdpa"]}  # as its record will be
                if (shape_name, seq_len, system_key(planned)) in have:
                    continue
                record = run_one(system, run, args, {**paths, "model": model}, env)
                halved, tried = run, []
                while record["status"] == "oom" and (halved := halve(system, halved)):  # as a user would: smaller
                    tried.append(record["micro_batches"])
                    print(f"{system}: out of memory at {tried[-1]}; again with half the micro-batch and twice the "
                          "accumulation", flush=True)  # fmt: skip
                    record = run_one(system, halved, args, {**paths, "model": model}, env)
                    record["micro_batches"] += f" (out of memory at {', '.join(tried)})"
                done.append(record)
                with open(work / "runs.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
                print(json.dumps({k: record.get(k) for k in ("shape", "seq_len", "system", "status",
                      "tokens_per_second", "mfu", "peak_memory_mb", "final_loss", "wall_seconds")}), flush=True)  # fmt: skip
                if args.out:  # as each run finishes, so a command cut off at its time limit keeps what it measured
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    shutil.copy(work / "runs.jsonl", Path(args.out) / "runs.jsonl")
    text = table(done)
    print(text)
    if args.out:
        (Path(args.out) / "gpu_vs_peers.md").write_text(text + "\n")
    if not (args.smoke or args.no_write or args.out):
        write_section("gpu_vs_peers", text)
    if any(r["status"] == "failed" or (args.smoke and r["status"] != "ok") for r in done):
        sys.exit("some runs failed: see their logs in " + str(work))


def importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def lora_fits(setting: str, work: Path, memory_gib: float) -> bool:
    """Whether to run the 8B LoRA part: 16 GB of bf16 weights on disk, about 30 GiB on the GPU."""
    free_gib = shutil.disk_usage(work).free / 2**30
    if setting == "on" or (setting == "auto" and free_gib >= 24 and memory_gib >= 40):
        return True
    if setting == "auto":
        print(f"skipping the 8B LoRA runs: {free_gib:.0f} GiB free disk, {memory_gib:.0f} GiB GPU memory", flush=True)
    return False


if __name__ == "__main__":
    main()
