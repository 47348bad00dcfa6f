"""What scoping Tunebook's process-wide settings costs (issue 43, point 5): the fused CPU layers fused for one model
instead of patched into transformers for the whole process, and dynamo's `suppress_errors` set around each compiled
block's call instead of once for the process.

    python benchmarks/side_effects.py [--steps 20] [--label TEXT] [--write]

The fused layers: one training step (forward and backward) of the vs_peers model (a 4 x 128 Llama, packed rows of
`--rows` x 512, float32) with transformers' own RMSNorm and rotary, then with the fused ones, alternating, median of
`--steps` each. Run it once with this tree's `src` and once with an older tree's (PYTHONPATH) to compare the global
patch with the scoped one: `set_fused_cpu_layers(model, enabled)` is the switch in both.
"""

from __future__ import annotations

import argparse
import statistics
import time

from results import header, write_section

ROW_LENGTH = 512


def _model():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=8192,
                                  max_position_embeddings=ROW_LENGTH)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()


def fused_layer_steps(steps: int, rows: int) -> dict[str, float]:
    import torch

    import tunebook.models.fused_cpu as fused_cpu

    model = _model()
    ids = torch.randint(1, 8192, (rows, ROW_LENGTH), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"transformers": [], "fused": []}
    for step in range(2 * steps + 2):
        name = "fused" if step % 2 else "transformers"
        fused_cpu.set_fused_cpu_layers(model, name == "fused")
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        if step >= 2:  # the first of each warms up
            times[name].append(time.perf_counter() - start)
    fused_cpu.set_fused_cpu_layers(model, True)
    return {name: statistics.median(t) for name, t in times.items()}


def suppress_errors_cost(calls: int = 20000) -> float:
    """Seconds per `compat.suppress_compile_errors()` entered and left (around each compiled block's call under
    torch_compile: auto), or 0 in a tree without it (where the setting was set once for the process)."""
    try:
        from tunebook.compat import suppress_compile_errors
    except ImportError:
        return 0.0
    start = time.perf_counter()
    for _ in range(calls):
        with suppress_compile_errors():
            pass
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=8, help="packed rows of 512 per step (vs_peers: 8)")
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--write", action="store_true", help="write the section of RESULTS.md")
    args = parser.parse_args()
    step = fused_layer_steps(args.steps, args.rows)
    patch = suppress_errors_cost()
    saving = 1 - step["fused"] / step["transformers"]
    figures = [args.label, f"{args.rows} x {ROW_LENGTH}", f"{1000 * step['transformers']:.0f}",
               f"{1000 * step['fused']:.0f}", f"{100 * saving:.1f}%", f"{1e6 * patch:.1f}"]  # fmt: skip
    line = "| " + " | ".join(figures) + " |"
    print(line)
    if args.write:
        body = [*header("Process-wide settings scoped: their cost (benchmarks/side_effects.py)"), "",
                "| tree | rows | step, transformers' layers (ms) | step, fused layers (ms) | saved | suppress_errors "
                "context per call (µs) |", "| --- | --- | ---: | ---: | ---: | ---: |", line]  # fmt: skip
        write_section("side_effects", "\n".join(body))


if __name__ == "__main__":
    main()
