"""`tunebook plan RECIPE --config FILE.yaml [--config_file ACCELERATE.yaml] [--gpu NAME | --gpu_memory 24GiB]
[--num_gpus N] [--architecture PATH] [--teacher_architecture PATH] [--mfu 0.4] [--json] [--key value ...]`: a run's memory per device and its
speed before it launches (`tunebook.planning`), and what to change when it does not fit.

The model is built from its config.json on fake tensors: nothing is downloaded but that file (or nothing, with
`--architecture`), no weights are loaded, and it runs in seconds on a laptop for an 8B or a 70B config.
"""

from __future__ import annotations

import json
import sys

__all__ = ["format_plan", "plan_command"]

OPTIONS = ("--config_file", "--gpu", "--gpu_memory", "--num_gpus", "--architecture", "--teacher_architecture", "--mfu")


def plan_command(argv: list[str]) -> dict:
    """Print the plan of a recipe config (as a table, or one JSON object with --json); returns its dict."""
    from ..config import load_config
    from ..errors import ConfigError
    from ..planning import hardware, plan, read_layout
    from ..planning.architecture import model_config_of
    from ..planning.memory import DEFAULT_MFU
    from ..planning.recommend import recommend
    from ..recipe import RECIPES, recipe_config_class
    from .arguments import pop_option

    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    if not argv or argv[0] not in RECIPES:
        print(f"tunebook: error: plan takes a RECIPE ({', '.join(RECIPES)}) first, got {argv[:1]}", file=sys.stderr)
        raise SystemExit(2)
    recipe, argv = argv[0], argv[1:]
    options = {}
    for name in OPTIONS:
        options[name], argv = pop_option(argv, name, "")
    try:
        gpus = int(options["--num_gpus"] or 0) or None
        mfu = float(options["--mfu"] or DEFAULT_MFU)
    except ValueError:
        raise ConfigError(f"--num_gpus takes a whole number and --mfu a fraction, got {options['--num_gpus']!r} "
                          f"and {options['--mfu']!r}") from None  # fmt: skip
    config = load_config(recipe_config_class(recipe), argv, check_files=False)  # the data and vLLM may be elsewhere
    layout = read_layout(options["--config_file"] or None, gpus)
    device = hardware(options["--gpu"] or None, options["--gpu_memory"] or None, layout.processes)
    model_config = model_config_of(config, options["--architecture"] or None)

    def planner(changed, changed_layout):
        return plan(
            recipe,
            changed,
            changed_layout,
            device,
            mfu=mfu,
            model_config=model_config,
            teacher_architecture=options["--teacher_architecture"] or None,
        )

    result = planner(config, layout)
    if not result.fits:
        result.recommendation, _ = recommend(config, layout, device.count, planner)
        if not result.recommendation:
            result.notes.append("nothing on the list fits: a larger GPU, more GPUs, or a shorter max_seq_length")
    found = result.as_dict()
    print(json.dumps(found) if as_json else format_plan(result, recipe, argv, options))
    return found


def format_plan(result, recipe: str, argv: list[str], options: dict) -> str:
    """The plan as a reader takes it in: parts in GiB with their share, the verdict, the speed, the change."""
    from ..planning import PARTS

    gib = 2**30
    batch = result.micro_batch
    lines = [
        f"Plan for `tunebook train {recipe}` on {result.processes} x {result.hardware} ({result.engine}), "
        f"micro-batch {batch['rows']} x {batch['length']} tokens, {batch['gradient_accumulation_steps']} "
        f"accumulation step(s); {_count(result.params)} parameters, {_count(result.trainable)} trained",
        "",
        "memory per device:",
    ]
    for part in PARTS:
        value = getattr(result, part)
        if value >= 0.005 * gib:  # shown to the hundredth of a GiB
            lines.append(f"  {part:<12} {value / gib:8.2f} GiB")
    verdict = "fits" if result.fits else "does NOT fit"
    lines.append(f"  {'peak':<12} {result.total / gib:8.2f} GiB of {result.device_memory / gib:.1f} GiB: {verdict}")
    lines.append("  (the peak is the step's or the generation's, over what stays; the parts are each at the peak)")
    lines.append("")
    lines.append(f"compute: {result.flops_per_token / 1e9:.3g} GFLOPs per token, {result.tokens_per_step:,} tokens per "
                 "optimizer step")  # fmt: skip
    if result.tokens_per_second:
        speed = (f"  at {result.mfu:.0%} MFU: {result.tokens_per_second:,.0f} tokens/s, "
                 f"{result.seconds_per_step:.2f} s per step")  # fmt: skip
        if result.seconds_total:
            speed += f", {result.steps} steps in {_duration(result.seconds_total)}"
        lines.append(speed)
    else:
        lines.append("  (speed: the GPU's FLOP/s are unknown; name it with --gpu)")
    for note in result.notes:
        lines.append(f"  note: {note}")
    if result.recommendation:
        launch = [o for o in result.recommendation if o.split()[0] in _ACCELERATE]
        keys = [o for o in result.recommendation if o.split()[0] not in _ACCELERATE]
        if not launch and options.get("--config_file"):
            launch = [f"--config_file {options['--config_file']}"]
        changed = {o.split()[0] for o in keys}
        argv = [a for i, a in enumerate(argv) if a not in changed and (i == 0 or argv[i - 1] not in changed)]
        lines += ["", "what fits (the first change a practitioner would try that does):", "  " + " ".join(
            ["tunebook train", *launch, recipe, *argv, *keys])]  # fmt: skip
    return "\n".join(lines)


_ACCELERATE = {"--config_file", "--num_processes", "--offload_optimizer_device", "--offload_param_device"}


def _count(number: int) -> str:
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if number >= size:
            return f"{number / size:.3g}{unit}"
    return str(number)


def _duration(seconds: float) -> str:
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"
