"""The memory plan against a measured run of every recipe on the CPU: the run's peak of allocated bytes (every
tensor it makes, `tunebook.planning.trace.measure_run`) within 10% of `tunebook plan`'s for the same config (KTO:
the plan an upper bound, at most 20% over: `ABOVE`).

The runs take the code path the plan models (the GPU's): no CPU-only fused layers, rows padded to the length the
config allows (the plan's assumption: rows as long as allowed). benchmarks/plan_accuracy.py measures the larger
grid (bf16, accumulation, DDP) into RESULTS.md."""

from __future__ import annotations

import json

import pytest
from recipe_runs import COMMON, TASKS
from support import TINY_TEST_MODEL

from tunebook import load_recipe
from tunebook.planning import Layout, hardware, plan
from tunebook.planning.trace import measure_run
from tunebook.recipe import recipe_config_class

# The tiny model's vocabulary as the plan sees it (a trained tokenizer of 300 stays under it: no resize).
MODEL = {**TINY_TEST_MODEL, "vocab_size": 512}
SHAPE = {"max_seq_length": 64, "pad_to_multiple_of": 64, "fused_cpu_layers": False, "max_steps": 4,
         "per_device_eval_batch_size": 1, "sample_prompts": [], "tokenizer_vocab_size": 300}  # fmt: skip
CASES = {
    # Packed rows with a loss on every token: the plan's micro-batch at every step.
    "sft": {"packing": True, "assistant_only_loss": False},
    "sft-lora-checkpointing": {
        "packing": True,
        "assistant_only_loss": False,
        "use_peft": True,
        "gradient_checkpointing": True,
    },  # fmt: skip
    "pretrain": {"pad_to_multiple_of": None},  # its rows are full blocks of max_seq_length
    "classify": {},
    "reward": {},
    "dpo": {},
    # One prompt (its rows all as long), planned at its length; completions at max_new_tokens; a reference.
    "grpo": {"pad_to_multiple_of": None, "beta": 0.04},
    # A teacher of the student's shape (the plan counts it at its own size), the data's completions only.
    "distill": {"teacher_model_config": MODEL, "lmbda": 0.0},
    "kto": {},
}
# The plan counts the loss's logits at every position; KTO's rows (one per micro-batch row, no chosen/rejected pair
# to share a prompt's length with) have short completions, and the run computes logits only there: the plan is an
# upper bound, 19% over on this tiny model where logits are a quarter of the step (measured 2026-11-28).
ABOVE = {"kto": 0.20}


@pytest.mark.parametrize("case", CASES)
def test_the_plan_is_within_ten_percent_of_a_measured_run(case, tmp_path):
    name = case.split("-")[0]
    recipe = load_recipe(name)
    model = {"model_config": MODEL} if "model_config" in TASKS[name] else {}
    values = {**COMMON, **TASKS[name], **model, **SHAPE, **CASES[case], "output_dir": str(tmp_path / "out"),
              "cache_dir": str(tmp_path / "cache")}  # fmt: skip
    if name == "grpo":
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text((json.dumps({"prompt": "reverse the digits 40213", "answer": "31204"}) + "\n") * 64)
        values["train_data"] = str(prompts)
    fields = recipe_config_class(name).__dataclass_fields__
    measured = measure_run(name, recipe.config(**{k: v for k, v in values.items() if k in fields}))
    config = recipe.config(**{k: v for k, v in values.items() if k in fields})
    if name == "grpo":  # the prompt's length as the run's tokenizer made it (the prepared data, cached)
        import logging

        from tunebook.rl.prompts import prepare_text_prompt_data

        data = prepare_text_prompt_data(config, tmp_path / "cache", logging.getLogger("test"))
        config.max_prompt_length = max(len(ids) for ids in data.train["prompt_ids"])
    planned = plan(name, config, Layout(), hardware("H100"), on_gpu=False)
    if case in ABOVE:
        assert measured.peak <= planned.allocated <= (1 + ABOVE[case]) * measured.peak, (planned.as_dict(), measured)
        return
    assert planned.allocated == pytest.approx(measured.peak, rel=0.10), (planned.as_dict(), measured.at_peak)
