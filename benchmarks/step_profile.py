"""Where one training step of recipes/sft.py spends its time: torch.profiler over steps of the real recipe.

    python benchmarks/step_profile.py [--data code_alpaca|sharegpt] [--examples 2000] [--steps 5] [--no_write]

The model, tokenizer and data are those of benchmarks/vs_peers.py (same work dir layout; built if missing); the
recipe runs in this process with packing, fp32, batch 8, and the profiler records `--steps` optimizer steps after
3 steps of warm-up. Self CPU time of every operator is grouped by what it does; the table goes to
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

from results import header, write_section

ROOT = Path(__file__).resolve().parents[1]
GROUPS = [  # first match wins
    ("optimizer (fused AdamW)", ("adam",)),
    ("attention (SDPA per example)", ("scaled_dot_product", "flash_attention", "_efficient_attention", "attention")),
    ("matmul (linear layers, LM head)", ("mm", "matmul", "linear", "bmm", "addmm")),
    ("loss (log-softmax, NLL)", ("log_softmax", "nll_loss", "cross_entropy")),
    ("gradient clipping and norms", ("norm", "clamp", "_foreach")),
    ("embedding", ("embedding",)),
]


def group(name: str) -> str:
    lowered = name.lower()
    for label, keys in GROUPS:
        if any(k in lowered for k in keys):
            return label
    return "elementwise and other (RMSNorm, RoPE, SiLU, copies)"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="code_alpaca", choices=["code_alpaca", "sharegpt"])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--work_dir", default="/tmp/tunebook-vs-peers")
    parser.add_argument("--no_write", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule
    from vs_peers import BATCH, LR, MAX_LEN, prepare_assets

    from tunebook import load_recipe

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data, model_dir = prepare_assets(work, args.examples, args.data)
    recipe = load_recipe("sft")
    warmup = 3
    config = recipe.config(
        model_name_or_path=str(model_dir), train_data=str(data), packing=True, max_seq_length=MAX_LEN,
        per_device_train_batch_size=BATCH, learning_rate=LR, lr_scheduler_type="linear", warmup_ratio=0.0,
        max_steps=warmup + args.steps + 1, eval_on_start=False, generation_eval=False, disable_tqdm=True,
        logging_steps=1, report_to="none", output_dir=str(work / "profile-out"), overwrite_output_dir=True,
        cache_dir=str(work / "cache-profile"),
    )  # fmt: skip
    captured = []
    prof = profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=warmup, active=args.steps, repeat=1),
        on_trace_ready=lambda p: captured.append(p.key_averages()),
    )
    real = recipe.module.optimizer_step_or_skip

    def step_and_tick(run, state, optimizer, finite):
        updated = real(run, state, optimizer, finite)
        prof.step()
        return updated

    recipe.module.optimizer_step_or_skip = step_and_tick
    with prof:
        recipe.main(config)
    events = captured[0]
    total = sum(e.self_cpu_time_total for e in events)
    by_group: dict[str, float] = defaultdict(float)
    for e in events:
        by_group[group(e.key)] += e.self_cpu_time_total
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    lines = [
        *header(
            f"Where a training step goes: recipes/sft.py with packing on {args.data} (benchmarks/step_profile.py)"
        ),
        f"- Setup: the vs_peers model, tokenizer and data ({args.examples} examples), packing, max_seq_length "
        f"{MAX_LEN}, batch {BATCH}, fp32, {torch.get_num_threads()} threads; `torch.profiler` over {args.steps} "
        f"optimizer steps after {warmup} of warm-up; self CPU time per operator, grouped.",
        "",
        "| where | share of the step | ms per step |",
        "| --- | ---: | ---: |",
    ]
    for label, t in sorted(by_group.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {label} | {t / total:.1%} | {t / args.steps / 1000:.1f} |")
    lines += ["", "Top operators:", "", "| operator | share | calls per step |", "| --- | ---: | ---: |"]
    for e in top:
        lines.append(f"| `{e.key}` | {e.self_cpu_time_total / total:.1%} | {e.count / args.steps:.0f} |")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section(f"step_profile_{args.data}", text)


if __name__ == "__main__":
    main()
