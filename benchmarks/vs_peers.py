"""Tunebook SFT against what users would pick instead, on the same model, tokenizer, data and settings.

    python benchmarks/vs_peers.py [--data code_alpaca|sharegpt] [--examples 2000] [--repeats 3] [--precisions fp32,bf16]

(a) Tunebook `recipes/sft.py` with packing, through `tunebook train` (the README's launch command);
(b) transformers `Trainer`, prompt-masked, padding to the longest in each batch (benchmarks/peers/trainer_sft.py);
(c) TRL `SFTTrainer` with packing (benchmarks/peers/trl_sft.py; `pip install -e ".[bench]"`).

All three start from the same saved tiny Llama (4 layers, hidden 128) and the same BPE tokenizer trained on the
data, and train one epoch of the same Code Alpaca subset at max_seq_length 512, batch 8, learning rate 5e-4,
linear schedule, no evaluation, saving the final model. Runs alternate between the systems; each repeat runs
every system with a cold data cache and then a warm one. Reported as medians: whole-process wall time, non-padding
tokens trained per second of training, time from process start to the end of the first optimizer step, and peak
RSS. The results go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from results import header, write_section

ROOT = Path(__file__).resolve().parents[1]
DATA = {  # name: (file, what it is)
    "code_alpaca": (ROOT.parent / "shared" / "data" / "code_alpaca_2k" / "code_alpaca_2k.json",
                    "Code Alpaca (`../shared/data/code_alpaca_2k`)"),
    "sharegpt": (ROOT.parent / "shared" / "data" / "sharegpt_fastchat_dummy" / "dummy_conversation.json",
                 "FastChat's ShareGPT sample, whole multi-turn conversations (`../shared/data/sharegpt_fastchat_dummy`)"),
}  # fmt: skip
SYSTEMS = ("tunebook", "trainer", "trl")
BATCH, LR, MAX_LEN = 8, 5e-4, 512


def sharegpt_messages(record: dict) -> list[dict[str, str]]:
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": roles[turn["from"]], "content": turn["value"]} for turn in record["conversations"]]


def prepare_assets(work: Path, examples: int, dataset: str) -> tuple[Path, Path]:
    """The data subset, and one model directory (initial weights + tokenizer) that every system loads."""
    sys.path.insert(0, str(ROOT / "src"))
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunebook.config.tiny import TINY_LLAMA
    from tunebook.data.formats import to_conversations
    from tunebook.models import train_chat_tokenizer

    records = json.loads(DATA[dataset][0].read_text())[:examples]
    if dataset == "sharegpt":  # as chat messages, which every system reads (Tunebook also reads ShareGPT itself)
        records = [{"messages": sharegpt_messages(r)} for r in records]
    data = work / f"{dataset}_subset.json"
    data.write_text(json.dumps(records))
    model_dir = work / f"init_model_{dataset}"
    if not (model_dir / "config.json").is_file():
        if dataset == "sharegpt":
            conversations = [r["messages"] for r in records]
        else:
            batch = {k: [r.get(k, "") for r in records] for k in ("instruction", "input", "output")}
            rows = to_conversations(batch, data_format="alpaca", where="")["conversation"]
            conversations = [json.loads(row)["messages"] for row in rows]
        texts = [f"{m['role']}\n{m['content']}" for messages in conversations for m in messages]
        tokenizer = train_chat_tokenizer(texts, vocab_size=2048)
        values = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
        config = AutoConfig.for_model("llama", **values, vocab_size=len(tokenizer),
                                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                      bos_token_id=None)  # fmt: skip
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    return data, model_dir


def tunebook_command(model_dir: Path, data: Path, out: Path, cache: Path, *overrides: str, launcher=()) -> list[str]:
    """recipes/sft.py with this benchmark's settings, launched as the README does (`tunebook train`)."""
    return [str(Path(sys.executable).parent / "tunebook"), "train", "--quiet",
            "--config_file", str(ROOT / "accelerate_configs" / "cpu.yaml"), *launcher, "sft",
            "--model_name_or_path", str(model_dir), "--train_data", str(data), "--packing", "true",
            "--max_seq_length", str(MAX_LEN), "--num_train_epochs", "1", "--per_device_train_batch_size", str(BATCH),
            "--learning_rate", str(LR), "--lr_scheduler_type", "linear", "--warmup_ratio", "0",
            "--eval_on_start", "false", "--generation_eval", "false", "--disable_tqdm", "true",
            "--cache_dir", str(cache), "--output_dir", str(out), *overrides]  # fmt: skip


def run_one(system: str, precision: str, data: Path, model_dir: Path, work: Path, cold: bool) -> dict:
    cache = work / f"cache-{system}"
    if cold:
        shutil.rmtree(cache, ignore_errors=True)
    out = work / f"out-{system}"
    shutil.rmtree(out, ignore_errors=True)
    result = work / f"result-{system}.json"
    result.unlink(missing_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(cache / "hf"), "TUNEBOOK_CACHE": str(cache / "tunebook")}  # fmt: skip
    bf16 = precision == "bf16"
    if system == "tunebook":
        cmd = tunebook_command(model_dir, data, out, cache / "tunebook", "--logging_steps", "10",
                               launcher=("--mixed_precision", "bf16" if bf16 else "no"))  # fmt: skip
    else:
        script = ROOT / "benchmarks" / "peers" / f"{system}_sft.py"
        cmd = [sys.executable, str(script), str(data), str(model_dir), str(out), str(result),
               "--batch", str(BATCH), "--lr", str(LR), "--max_length", str(MAX_LEN), "--cache_dir", str(cache / "hf"),
               *(["--bf16"] if bf16 else [])]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{system} ({precision}) failed:\n{output[-4000:]}")
    if system == "tunebook":
        summary = json.loads((out / "summary.json").read_text())
        stats = {"tokens": summary["train_tokens"], "train_seconds": summary["train_runtime_seconds"],
                 "time_to_first_step": summary["time_to_first_step_seconds"],
                 "final_train_loss": summary["final_train_loss"],
                 "computed_positions": summary["train_tokens"] / (1 - summary["padding_fraction"])}  # fmt: skip
    else:
        stats = json.loads(result.read_text())
    return {
        "system": system,
        "precision": precision,
        "cache": "cold" if cold else "warm",
        "wall_seconds": wall,
        "tokens_per_second": stats["tokens"] / stats["train_seconds"],
        "tokens": stats["tokens"],
        # Every position the model computed (padding included): with equal cost per position, the tokens/s ratio
        # can be no more than the ratio of these per token.
        "positions_per_token": stats["computed_positions"] / stats["tokens"],
        "us_per_position": stats["train_seconds"] / stats["computed_positions"] * 1e6,
        "time_to_first_step": stats["time_to_first_step"],
        "peak_rss_mb": usage.ru_maxrss / 1024,  # the largest process of the run (Linux reports KiB)
        "final_train_loss": stats["final_train_loss"],
    }


def table(runs: list[dict], precision: str, systems: list[str]) -> str:
    def med(system, key, cache="warm"):
        values = [
            r[key] for r in runs if r["system"] == system and r["precision"] == precision and r["cache"] == cache
        ]
        return statistics.median(values) if values else float("nan")

    has_cold = any(r["cache"] == "cold" and r["precision"] == precision for r in runs)
    lines = [
        "| system | whole process, warm cache (s) | whole process, cold cache (s) | non-padding tokens/s | "
        "positions computed per token | µs per computed position | first step, cold (s) | first step, warm (s) | "
        "peak RSS (MB) | tokens trained | final loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    names = {"tunebook": "Tunebook SFT, packing", "trainer": "transformers Trainer, pad to longest",
             "trl": "TRL SFTTrainer, packing"}  # fmt: skip
    for s in systems:
        cold = lambda key, s=s: f"{med(s, key, 'cold'):.1f}" if has_cold else "–"  # noqa: E731
        lines.append(
            f"| {names[s]} | {med(s, 'wall_seconds'):.1f} | {cold('wall_seconds')} | {med(s, 'tokens_per_second'):.0f} "
            f"| {med(s, 'positions_per_token'):.2f} | {med(s, 'us_per_position'):.1f} | {cold('time_to_first_step')} "
            f"| {med(s, 'time_to_first_step'):.1f} | {med(s, 'peak_rss_mb'):.0f} | {med(s, 'tokens'):.0f} "
            f"| {med(s, 'final_train_loss'):.3f} |"
        )
    ratios = []
    for peer in systems[1:]:
        for cache in ("warm", "cold") if has_cold else ("warm",):
            r = med("tunebook", "wall_seconds", cache) / med(peer, "wall_seconds", cache)
            ratios.append(f"{r:.2f}x {names[peer].split(',')[0]} ({cache} cache)")
    lines.append("")
    lines.append("Tunebook's whole-process time: " + "; ".join(ratios) + ".")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--data", choices=sorted(DATA), default="code_alpaca")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--work_dir", default="/tmp/tunebook-vs-peers")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="a subset to compare, e.g. tunebook,trainer")
    parser.add_argument("--no_write", action="store_true", help="print the tables only")
    args = parser.parse_args()
    systems = [s for s in SYSTEMS if s in args.systems.split(",")]
    if args.systems.split(",") != systems or "tunebook" not in systems:
        parser.error(f"--systems: a comma-separated subset of {','.join(SYSTEMS)} that includes tunebook")
    if not args.no_write and systems != list(SYSTEMS):
        parser.error("a subset of --systems needs --no_write: RESULTS.md keeps the full comparison")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data, model_dir = prepare_assets(work, args.examples, args.data)
    runs = []
    for precision in args.precisions.split(","):
        for repeat in range(args.repeats):
            # Which system goes first alternates between repeats, so that neither always runs right after the other
            # (the machine's speed drifts within minutes).
            order = systems if repeat % 2 == 0 else systems[::-1]
            # Cold and warm caches for the headline precision; warm only for the second table.
            for cold in (True, False) if precision == "fp32" else (False,):
                for system in order:  # the fp32 runs leave warm caches behind for the bf16 ones
                    r = run_one(system, precision, data, model_dir, work, cold)
                    runs.append(r)
                    print(json.dumps(r), flush=True)
    (work / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    body = [
        *header(f"Tunebook vs transformers Trainer vs TRL on {args.data} (benchmarks/vs_peers.py)", "trl"),
        f"- Setup: tiny Llama (4 layers, hidden 128, 2048-token BPE vocabulary trained on the data), the first "
        f"{args.examples} examples of {DATA[args.data][1]}, one epoch, max_seq_length "
        f"{MAX_LEN}, batch {BATCH}, learning rate {LR}, linear schedule, no evaluation, final model saved. Medians of "
        f"{args.repeats} runs per system, runs alternating between systems (which goes first alternating between "
        "repeats). Whole-process time is measured from "
        "outside (launch to exit, `accelerate launch` included for Tunebook); tokens/s counts non-padding tokens "
        "per second of the training loop; first step is from process start to the end of the first optimizer step.",
    ]
    for precision in args.precisions.split(","):
        label = "fp32" if precision == "fp32" else "bf16 autocast"
        body += ["", f"### {label}", "", table(runs, precision, systems)]
    text = "\n".join(body)
    print(text)
    if not args.no_write:
        write_section("vs_peers" if args.data == "code_alpaca" else f"vs_peers_{args.data}", text)


if __name__ == "__main__":
    main()
