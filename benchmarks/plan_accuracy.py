"""How close `tunebook plan` comes to a measured run, on this machine's CPU: every recipe, full and LoRA, with and
without gradient checkpointing and bf16 autocast, gradient accumulation, and 2-process DDP.

    .venv/bin/python benchmarks/plan_accuracy.py [--cases pretrain,sft-lora,...] [--from_records FILE]

Each case is a real recipe run (`tunebook.planning.trace.measure_run`: every tensor the run makes counted from its
creation until it is freed, the CPU's stand-in for `torch.cuda.max_memory_allocated`) for 3 optimizer steps, next
to the plan of the same config (`plan.allocated`: the total without the CUDA-only context and allocator slack).
The runs use what the planner models, the GPU's code path: `fused_cpu_layers: false` (the CPU-only fused layers
save less), batches padded to `max_seq_length` (`pad_to_multiple_of`, as the plan assumes rows as long as the config
allows), no evaluation or generated samples (the plan is of training). A multi-process case runs under `accelerate
launch` and reports its main process.

Raw records (one JSON object per case) go to benchmarks/records/<date>-plan_accuracy-<machine>.jsonl; the table to
RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

from results import header, write_section

ROOT = Path(__file__).resolve().parents[1]

COMMON = {
    "max_steps": "3", "eval_on_start": "false", "save_strategy": "no", "report_to": "none", "logging_steps": "1",
    "per_device_eval_batch_size": "1", "dataloader_num_workers": "0", "torch_compile": "false",
    "fused_cpu_layers": "false", "generation_eval": "false", "sample_prompts": "[]",
}  # fmt: skip
PACKED = {"packing": "true", "max_seq_length": "256", "per_device_train_batch_size": "8"}
# (name, recipe, overrides, mixed precision, processes)
CASES = [
    ("pretrain", "pretrain", {"max_seq_length": "256", "per_device_train_batch_size": "8"}, "no", 1),
    ("pretrain-bf16", "pretrain", {"max_seq_length": "256", "per_device_train_batch_size": "8"}, "bf16", 1),
    ("sft-packed", "sft", PACKED, "no", 1),
    ("sft-checkpointing", "sft", {**PACKED, "gradient_checkpointing": "true"}, "no", 1),
    ("sft-lora", "sft", {**PACKED, "use_peft": "true"}, "no", 1),
    ("sft-lora-bf16", "sft", {**PACKED, "use_peft": "true"}, "bf16", 1),
    ("sft-accumulation", "sft", {**PACKED, "gradient_accumulation_steps": "2"}, "no", 1),
    (
        "sft-padded",
        "sft",
        {"packing": "false", "max_seq_length": "128", "pad_to_multiple_of": "128", "per_device_train_batch_size": "8"},
        "no",
        1,
    ),  # fmt: skip
    ("dpo", "dpo", {"per_device_train_batch_size": "8", "pad_to_multiple_of": "64"}, "no", 1),
    ("dpo-lora", "dpo", {"per_device_train_batch_size": "8", "pad_to_multiple_of": "64", "use_peft": "true"}, "no", 1),
    ("reward", "reward", {"per_device_train_batch_size": "8", "pad_to_multiple_of": "64"}, "no", 1),
    ("classify", "classify", {"per_device_train_batch_size": "16", "pad_to_multiple_of": "128"}, "no", 1),
    # One prompt repeated (every row as long), planned at its tokenised length (`_prompt_length`); a reference.
    (
        "grpo",
        "grpo",
        {"per_device_train_batch_size": "4", "sft_warmup_steps": "0", "beta": "0.04", "train_data": "ONE_PROMPT"},
        "no",
        1,
    ),  # fmt: skip
    ("sft-ddp-2", "sft", PACKED, "no", 2),
]


def config_of(recipe: str, overrides: dict, output_dir: str):
    from tunebook.config import parse_config
    from tunebook.recipe import recipe_config_class

    cls = recipe_config_class(recipe)
    values = {**COMMON, **overrides, "output_dir": output_dir}
    return parse_config(cls, overrides={k: v for k, v in values.items() if k in cls.__dataclass_fields__})


def planned(recipe: str, overrides: dict, mixed: str, processes: int) -> dict:
    """The plan of a case as the CPU runs it (`on_gpu=False`: no CUDA context or allocator slack)."""
    from tunebook.planning import PARTS, Layout, hardware, plan

    config = config_of(recipe, overrides, tempfile.gettempdir())
    layout = Layout("ddp" if processes > 1 else "single", processes, mixed)
    made = plan(recipe, config, layout, hardware("H100"), on_gpu=False)
    return {"planned_bytes": made.allocated, "planned_parts": {part: getattr(made, part) for part in PARTS}}


def run_case(name: str) -> dict:
    """One case in this process (launched by `accelerate launch` for several): measured and planned."""
    from accelerate import PartialState

    from tunebook.planning.trace import measure_run

    _, recipe, overrides, mixed, processes = next(case for case in CASES if case[0] == name)
    output_dir = os.environ.get("PLAN_ACCURACY_OUT") or tempfile.mkdtemp(prefix="plan-accuracy-")
    if overrides.get("train_data") == "ONE_PROMPT":
        prompts = Path(output_dir) / "prompts.jsonl"
        prompts.write_text((json.dumps({"prompt": "reverse the digits 40213", "answer": "31204"}) + "\n") * 512)
        overrides = {**overrides, "train_data": str(prompts)}
    measured = measure_run(recipe, config_of(recipe, overrides, output_dir))
    if recipe == "grpo":  # the prompt's length as the run's tokenizer made it (its prepared data, cached)
        overrides = {**overrides, "max_prompt_length": str(_prompt_length(config_of(recipe, overrides, output_dir)))}
    plan = planned(recipe, overrides, mixed, processes)
    record = {"case": name, "recipe": recipe, "overrides": overrides, "mixed_precision": mixed,
              "processes": processes, **plan, "measured_bytes": measured.peak,
              "ratio": plan["planned_bytes"] / measured.peak, "measured_at_peak": measured.at_peak}  # fmt: skip
    if PartialState().is_main_process:
        print("RECORD " + json.dumps(record), flush=True)
    return record


def _prompt_length(config) -> int:
    import logging

    from tunebook.rl.prompts import prepare_text_prompt_data

    data = prepare_text_prompt_data(config, Path(config.cache_dir), logging.getLogger("plan_accuracy"))
    return max(len(ids) for ids in data.train["prompt_ids"])


def launch(name: str) -> dict:
    _, _, _, mixed, processes = next(case for case in CASES if case[0] == name)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ACCELERATE_MIXED_PRECISION": mixed,
           "PLAN_ACCURACY_OUT": tempfile.mkdtemp(prefix="plan-accuracy-")}  # fmt: skip
    if processes > 1:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "accelerate_configs" / "multi_cpu.yaml"), "--num_processes", str(processes),
                   __file__, "--run_case", name]  # fmt: skip
    else:
        command = [sys.executable, __file__, "--run_case", name]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RECORD ")]
    if result.returncode or not lines:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RECORD "))


def table(records: list[dict]) -> str:
    mib = 2**20
    rows = ["| case | recipe | mixed precision | processes | planned MiB | measured MiB | planned / measured |",
            "| --- | --- | --- | --- | ---: | ---: | ---: |"]  # fmt: skip
    for r in records:
        rows.append(f"| {r['case']} | {r['recipe']} | {r['mixed_precision']} | {r['processes']} | "
                    f"{r['planned_bytes'] / mib:.1f} | {r['measured_bytes'] / mib:.1f} | {r['ratio']:.3f} |")  # fmt: skip
    worst = max(abs(r["ratio"] - 1) for r in records)
    rows.append("")
    rows.append(f"Largest difference: {worst:.1%} of the measured peak.")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(case[0] for case in CASES))
    parser.add_argument("--run_case", help=argparse.SUPPRESS)
    parser.add_argument("--from_records", help="re-write the table from a records file, running nothing")
    parser.add_argument("--replan", action="store_true", help="with --from_records: plan the recorded cases again "
                        "with today's planner (the measured peaks stay as recorded)")  # fmt: skip
    args = parser.parse_args()
    if args.run_case:
        run_case(args.run_case)
        return
    if args.from_records:
        records = [json.loads(line) for line in Path(args.from_records).read_text().splitlines() if line.strip()]
        path = Path(args.from_records).resolve()
        if args.replan:
            for r in records:
                r.update(planned(r["recipe"], r["overrides"], r["mixed_precision"], r["processes"]))
                r["ratio"] = r["planned_bytes"] / r["measured_bytes"]
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path = ROOT / "benchmarks" / "records" / f"{date.today().isoformat()}-plan_accuracy-cpu.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        # Today's records of other cases stay: a run of some cases replaces only theirs.
        names = args.cases.split(",")
        kept = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        records = [r for r in kept if r["case"] not in names]
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        for name in names:
            record = launch(name)
            records.append(record)
            with path.open("a") as f:  # as they come: a cut-off run keeps the cases it finished
                f.write(json.dumps(record) + "\n")
            print(f"{name}: planned {record['planned_bytes'] / 2**20:.1f} MiB, measured "
                  f"{record['measured_bytes'] / 2**20:.1f} MiB ({record['ratio']:.3f})", flush=True)  # fmt: skip
    text = "\n".join([*header("Memory plan vs measured run, CPU (benchmarks/plan_accuracy.py)"), "", table(records)])
    write_section("plan_accuracy", text + f"\n\nRaw records: `{path.relative_to(ROOT)}`.")
    print(table(records))


if __name__ == "__main__":
    main()
