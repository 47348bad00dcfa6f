"""The `tunebook` command.

    tunebook train [ACCELERATE LAUNCH OPTIONS] RECIPE [--config FILE.yaml] [--key value ...]
    tunebook prepare [--recipe RECIPE] --config FILE.yaml [--key value ...]
    tunebook prepare --recipe pretrain|sft --config FILE.yaml --num_shards N --output DIR
    tunebook export CHECKPOINT OUT_DIR [--merge] [--trust_remote_code]
    tunebook convert-gguf MODEL.gguf OUT_DIR
    tunebook report RUN_DIR [RUN_DIR ...] [--output FILE.png]
    tunebook plan RECIPE [--config FILE.yaml] [--config_file ACCELERATE.yaml] [--gpu NAME] [--num_gpus N] [--json]
    tunebook chat MODEL_DIR [--prompt TEXT] [--system TEXT] [--max_new_tokens N] [--temperature T]
    tunebook evaluate MODEL_DIR --tasks T [T ...] [--limit N] [--num_fewshot K] [--batch_size B] [--output FILE]

`prepare` builds the tokenised (and packed) data caches exactly as the recipe (`recipes/sft.py` by default) with the
same config would, without loading model weights or starting training, prints what it built and the data's content
fingerprint, and exits. Point `cache_dir` at a shared file system and a CPU machine can prepare data for a GPU job
(or for every node of a multi-node one); `--num_shards N --output DIR` also writes the tokenised (for pretrain and
packed sft, packed) training rows as N Arrow shards with their tokenizer, which any number of nodes then stream
(`train_data: {path: DIR, streaming: true}`) without tokenising again. `export` turns a checkpoint of any recipe, of
any number of processes, into a `from_pretrained`-ready model directory, rebuilt from the checkpoint alone; a LoRA
checkpoint gives its adapter directory, or with `--merge` the merged model. `convert-gguf`
dequantises a GGUF checkpoint into a safetensors model directory (once; the recipes then load it with
`model_name_or_path`). `report` re-renders each run's `report.png` from its `metrics.jsonl` and prints the runs'
summaries side by side, led by the config keys that differ; `--output` also draws all the runs into one figure.
`chat` talks to a saved causal LM or LoRA adapter (`tunebook.cli.chat`); `evaluate` runs
lm-evaluation-harness tasks on one (`tunebook.cli.evaluate`).

RECIPE is a name of `tunebook.recipe.RECIPES`, the one map of recipe names, which `tunebook --help` lists.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .arguments import pop_option

__all__ = ["main", "prepare", "report"]


USAGE = """usage: tunebook train [ACCELERATE LAUNCH OPTIONS] RECIPE [--config FILE.yaml] [--key value ...]
       tunebook prepare [--recipe RECIPE] --config FILE.yaml [--key value ...]
                        [--num_shards N --output DIR]
       tunebook export CHECKPOINT OUT_DIR [--merge] [--trust_remote_code]
       tunebook convert-gguf MODEL.gguf OUT_DIR
       tunebook report RUN_DIR [RUN_DIR ...] [--output FILE.png]
       tunebook plan RECIPE [--config FILE.yaml] [--config_file ACCELERATE.yaml] [--gpu NAME | --gpu_memory 24GiB]
                     [--num_gpus N] [--architecture CONFIG.json] [--teacher_architecture CONFIG.json] [--mfu 0.4]
                     [--json] [--key value ...]
       tunebook chat MODEL_DIR [--prompt TEXT] [--system TEXT] [--max_new_tokens N] [--temperature T]
       tunebook evaluate MODEL_DIR --tasks T [T ...] [--limit N] [--num_fewshot K] [--batch_size B]
                         [--output FILE] [--json]
       tunebook vllm-serve --model MODEL_DIR [--host HOST] [--port PORT] [vLLM server options]

commands:
  train     accelerate launch a RECIPE (below) or a recipe .py file: the config is checked first, and a failure or a
            stop signal ends with the recipe's own lines, not a launcher traceback
  prepare   build the tokenised (and packed) data caches of a recipe config, then exit; with --num_shards N
            --output DIR (pretrain, sft) also write the training rows as N Arrow shards to stream from every node
  export    write a Hugging Face model directory (safetensors + tokenizer) from a checkpoint of any recipe
            (a causal LM, or a sequence classifier with its labels or one output, as the recipe trained it);
            of a LoRA run: its adapter directory, or with --merge the merged model; a model with its own code
            (auto_map) needs --trust_remote_code (never taken from the checkpoint's config.yaml)
  convert-gguf  write a Hugging Face model directory (float32 safetensors + tokenizer) from a GGUF file
  report    re-render runs' report.png and print their summaries side by side
  plan      a run's peak memory per GPU (weights, gradients, optimizer, activations, logits, reference, generation)
            and its speed, from the config alone (the model built from its config.json on fake tensors: no
            weights); when it does not fit, the change that does, as overrides; --json for one JSON object
  chat      talk to a model a run saved (or its LoRA adapter) with its chat template, replies streamed; --prompt
            answers once and exits; in the conversation an empty line or /exit quits, /reset clears the history
  evaluate  lm-evaluation-harness tasks (registry names, or local task YAMLs that work offline) on a saved
            model, prompts in its chat template; needs pip install "tunebook[eval]"
  vllm-serve  start a vLLM server for GRPO's vllm_mode: server (weights reloaded from the trainer each step);
            needs vLLM (make vllm)
"""


def usage() -> str:
    """USAGE and the recipes, each with what it trains, from the one map of recipe names (`tunebook.recipe`)."""
    from ..recipe import RECIPES, recipe_task

    width = max(map(len, RECIPES))
    lines = [f"  {name:<{width}}  {recipe_task(name)[0]}" for name in RECIPES]
    header = "recipes (`tunebook train RECIPE --help` lists a recipe's keys by section, with their defaults):"
    return "\n".join([USAGE, header, *lines])


def prepare(argv: list[str]) -> dict:
    """Build the caches a recipe run with these arguments would use; returns the printed figures."""
    from ..config import load_config
    from ..recipe import recipe_config_class

    recipe, argv = pop_option(argv, "--recipe", "sft")
    output, argv = pop_option(argv, "--output", "")
    num_shards, argv = pop_option(argv, "--num_shards", "")
    config_class = recipe_config_class(recipe)
    start = time.perf_counter()
    config = load_config(config_class, argv)
    from ..distributed import data_fingerprint
    from ..recipe import recipe_data
    from ..run.logging import setup_logging

    prepare_data = recipe_data(recipe)
    log = setup_logging(True, config.log_level)
    cache_dir = Path(config.cache_dir).expanduser()
    data = prepare_data(config, cache_dir, log)  # under each cache entry's own lock (see tunebook.distributed)
    streamed = getattr(data, "stream", None) is not None  # its rows are made as training reads them: uncounted
    figures = {
        "recipe": recipe,
        "cache_dir": str(cache_dir),
        "train_rows": "streamed (made as training reads them)" if streamed else len(data.train),
        "train_tokens": None if streamed else data.stats.get("train_tokens_per_epoch") or _token_count(data.train),
        "eval_rows": 0 if data.eval is None else len(data.eval),
        "packing_efficiency": data.stats.get("packing_efficiency"),
        "train_fingerprint": None if streamed else data_fingerprint(data.train),  # compared across nodes
        "built": ", ".join(data.built) or "nothing (all cached)",
        "seconds": time.perf_counter() - start,
    }
    if output or num_shards:  # tokenised (and packed) rows as Arrow shards for nodes to stream
        figures["shards"] = _write_shards(recipe, config, data, output, num_shards)
    width = max(map(len, figures))
    for key, value in figures.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")
    return figures


def _write_shards(recipe: str, config, data, output: str, num_shards: str) -> str:
    from ..data.stream import write_prepared_shards

    if not output or not num_shards.isdigit() or recipe not in ("pretrain", "sft"):
        print(
            "tunebook: error: prepare --recipe pretrain|sft --num_shards N --output DIR writes shards to stream; got "
            f"--recipe {recipe} --num_shards {num_shards or '(none)'} --output {output or '(none)'}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if getattr(data, "stream", None) is not None:
        print("tunebook: error: prepare --output tokenises train_data whole: remove streaming: true", file=sys.stderr)
        raise SystemExit(2)
    meta = {"recipe": recipe, "max_seq_length": config.max_seq_length, "packing": getattr(config, "packing", True)}
    paths = write_prepared_shards(data.train, data.tokenizer, Path(output).expanduser(), int(num_shards), meta)
    return f"{len(paths)} in {output} (stream them with train_data: {{path: {output}, streaming: true}})"


def report(argv: list[str]) -> str:
    """Re-render each run's report.png (and with --output, one figure of all runs); print the comparison table."""
    from ..run.report import compare_runs, render_report

    output, run_dirs = pop_option(argv, "--output", "")
    if not run_dirs or any(d.startswith("-") for d in run_dirs):
        print(f"tunebook: error: report takes RUN_DIR [RUN_DIR ...] [--output FILE.png], got {argv}", file=sys.stderr)
        raise SystemExit(2)
    for run_dir in run_dirs:
        print(f"wrote {render_report([run_dir], Path(run_dir) / 'report.png')}")
    if output:
        print(f"wrote {render_report(run_dirs, output)}")
    table = compare_runs(run_dirs)
    print(table)
    return table


def _token_count(dataset) -> int:
    """Tokens of a prepared data set, from its Arrow list lengths (no Python lists built)."""
    import pyarrow.compute as pc

    columns = [c for c in dataset.column_names if c.endswith("input_ids")]  # both responses of preference pairs
    return sum(pc.sum(pc.list_value_length(dataset.data.column(c))).as_py() or 0 for c in columns)


def main(argv: list[str] | None = None) -> None:
    from ..errors import enter_command_line

    enter_command_line()
    whole_process = argv is None  # the console script, not a caller in Python
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command == "train":
        from .launch import train

        train(rest, whole_process=whole_process)
    elif command == "prepare":
        prepare(rest)
    elif command == "report":
        report(rest)
    elif command == "plan":
        from .plan import plan_command

        plan_command(rest)
    elif command == "chat":
        from .chat import chat

        chat(rest)
    elif command == "evaluate":
        from .evaluate import evaluate_command

        evaluate_command(rest)
    elif command == "vllm-serve":
        from .vllm_serve import vllm_serve

        vllm_serve(rest)
    elif command in ("export", "convert-gguf"):
        flags = set(rest) & ({"--merge", "--trust_remote_code"} if command == "export" else set())
        rest = [a for a in rest if a not in flags]
        if len(rest) != 2:
            what = "CHECKPOINT" if command == "export" else "MODEL.gguf"
            print(f"tunebook: error: {command} takes {what} OUT_DIR, got {rest}\n{USAGE}", file=sys.stderr)
            raise SystemExit(2)
        if command == "export":
            from ..run.export import export_checkpoint

            written = export_checkpoint(
                rest[0], rest[1], merge="--merge" in flags, trust_remote_code="--trust_remote_code" in flags
            )
            print(f"wrote {written} from {rest[0]}")
        else:
            from ..models.gguf import convert_gguf

            print(f"wrote {convert_gguf(rest[0], rest[1])} from {rest[0]}")
    else:
        print(f"tunebook: error: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
