"""`tunebook evaluate MODEL_DIR --tasks T [T ...]`: lm-evaluation-harness tasks on a saved model.

    tunebook evaluate outputs/sft-default --tasks tasks/my_task.yaml            # a local task, offline
    tunebook evaluate outputs/run --tasks arc_easy hellaswag --limit 200 --num_fewshot 5 --output scores.json
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml -m tunebook.cli evaluate outputs/run \\
        --tasks arc_easy                                                        # the requests split over GPUs

MODEL_DIR is what a causal-LM run saved or `tunebook export` wrote (a model or a LoRA adapter directory, loaded as
`tunebook chat` loads it). The tasks run through the same adapter as a run's `eval_harness_tasks`
(`tunebook.evaluation.harness`): the same prompts (the chat template when the tokenizer has one), batches and
figures, on any number of processes. Needs `pip install "tunebook[eval]"`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .arguments import whole_number

__all__ = ["evaluate_command", "format_results"]


def evaluate_command(argv: list[str]) -> dict | None:
    """Run the tasks, print the figures (a table, or one JSON object with --json) and with --output write them as
    JSON; returns summary.json's form of them (`harness_summary`) on the main process, None on the others."""
    args = _parser().parse_args(argv)
    from ..config.harness import harness_tasks
    from .chat import check_model_dir, load_chat_model

    check_model_dir(Path(args.model_dir).expanduser())  # what is not a model, and an unknown task: one line each,
    harness_tasks(args.tasks, key="--tasks")  # before any weights load
    import torch
    from accelerate import PartialState

    from ..evaluation.harness import harness_summary, run_harness

    # One process, or each of `accelerate launch`'s; on a machine without a GPU they meet in a gloo group (as the
    # recipes' Accelerator does there), whatever the launch config says.
    state = PartialState(cpu=not torch.cuda.is_available())
    model, tokenizer = load_chat_model(args.model_dir, trust_remote_code=args.trust_remote_code)
    model.to(state.device)
    results = run_harness(model, tokenizer, args.tasks, state if state.num_processes > 1 else None,
                          limit=args.limit, num_fewshot=args.num_fewshot, batch_size=args.batch_size,
                          chat_template=args.chat_template, disable_tqdm=not sys.stderr.isatty(),
                          log_samples=args.log_samples)  # fmt: skip
    if not state.is_main_process:  # the same results on every process: one prints them
        return None
    summary = harness_summary(results, step=0)
    summary["model"] = str(args.model_dir)
    if args.log_samples:  # each request's arguments and answers, as lm-eval logs them
        summary["samples"] = results["samples"]
    print(json.dumps(summary, default=str) if args.json else format_results(summary))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(summary, indent=2, default=str) + "\n")
        if not args.json:
            print(f"wrote {args.output}")
    return summary


def format_results(summary: dict) -> str:
    """One line per task and metric: its value, documents and few-shot examples."""
    rows = [("task", "metric", "value", "documents", "few-shot")]
    for task, metrics in summary["tasks"].items():
        for metric, value in metrics.items():
            rows.append((task, metric, f"{value:.4f}", str(summary["documents"].get(task, "")),
                         str(summary["num_fewshot"].get(task, ""))))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tunebook evaluate",
                                     description="lm-evaluation-harness tasks on a saved model.")  # fmt: skip
    parser.add_argument("model_dir", help="a model or LoRA adapter directory (a run's output_dir, or an export)")
    parser.add_argument("--tasks", nargs="+", required=True,
                        help="lm-eval task, group or tag names, or local task YAMLs or directories of them")  # fmt: skip
    parser.add_argument("--limit", type=whole_number(1), help="at most this many documents per task")
    parser.add_argument(
        "--num_fewshot", type=whole_number(0), help="few-shot examples per prompt (default: the task's)"
    )
    parser.add_argument("--batch_size", type=whole_number(1), default=8, help="requests per forward pass (8)")
    parser.add_argument("--chat_template", type=_yes_no, default=None,
                        help="true/false: render prompts with the chat template (default: when the tokenizer "
                             "has one)")  # fmt: skip
    parser.add_argument("--output", help="also write the figures to this JSON file")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--log_samples", action="store_true", help="add every request and answer to the JSON")
    parser.add_argument("--trust_remote_code", action="store_true", help="allow the model's own Python code")
    return parser


def _yes_no(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"
