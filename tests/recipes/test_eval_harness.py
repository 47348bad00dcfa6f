"""`eval_harness_tasks` in a causal-LM run: lm-evaluation-harness on the model in memory, before training, at each
evaluation and at the end, in metrics.jsonl, summary.json, the report and the model card; the figures at the end are
the saved model's."""

from __future__ import annotations

import importlib.util
import json

import pytest
from recipe_runs import _records, _run, _weights, _without_rates
from support import TINY_TEST_MODEL, assert_png, launch, write_harness_tasks

from tunebook.recipe import RECIPES, recipe_config_class

if importlib.util.find_spec("lm_eval") is None:  # not importorskip: lm-eval is imported as tunebook imports it
    pytest.skip('lm-evaluation-harness is not installed: pip install "tunebook[eval]"', allow_module_level=True)


def test_sft_run_reports_the_harness_figures_of_the_model_it_saves(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunebook.evaluation.harness import harness_figures, run_harness

    tasks = write_harness_tasks(tmp_path / "tasks", rows=20)
    out = tmp_path / "run"
    names = [str(tasks["choice"]), str(tasks["reply"])]
    summary = _run("sft", out, tmp_path / "cache", eval_harness_tasks=names, eval_harness_at_eval=True,
                   eval_steps=3, eval_on_start=True, eval_harness_limit=12)  # fmt: skip

    harness = [r for r in _records(out) if any(k.startswith("harness/") for k in r)]
    assert [r["step"] for r in harness] == [0, 3, 6]  # before training, at the evaluation, at the end
    final = {k: v for k, v in harness[-1].items() if k != "step"}
    assert sorted(final) == ["harness/tiny_choice/acc", "harness/tiny_reply/exact_match"]
    written = json.loads((out / "summary.json").read_text())["eval_harness"]
    assert written == summary["eval_harness"]
    assert written["tasks"] == {"tiny_choice": {"acc": final["harness/tiny_choice/acc"]},
                                "tiny_reply": {"exact_match": final["harness/tiny_reply/exact_match"]}}  # fmt: skip
    assert written["documents"] == {"tiny_choice": 12, "tiny_reply": 12} and written["chat_template"] is True

    # The model in memory at the end is the one saved: the saved model, loaded afresh, scores the same.
    model, tokenizer = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    again = harness_figures(run_harness(model, tokenizer, names, limit=12, batch_size=8))
    assert again == final

    # Training went on exactly as without the harness: the same losses, evaluations and weights.
    _run("sft", tmp_path / "plain", tmp_path / "cache", eval_steps=3, eval_on_start=True)
    plain = [_without_rates(r) for r in _records(tmp_path / "plain")]
    assert [_without_rates(r) for r in _records(out) if r not in harness] == plain
    assert _weights(out) == _weights(tmp_path / "plain")

    card = (out / "README.md").read_text()
    assert "## Benchmarks" in card and "| tiny_choice | acc |" in card
    assert "model-index:" in card and "lm-evaluation-harness" in card
    assert_png(out / "report.png")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_zero3_sharded_two_process_run_reports_what_one_process_finds_on_its_model(tmp_path):
    """Under DeepSpeed ZeRO-3 (on the CPU, 2 processes) every weight is a shard: each forward pass and each generated
    token gathers them on all processes at once. The run's figures equal one process's on the model it saved."""
    pytest.importorskip("deepspeed")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunebook.evaluation.harness import harness_figures, run_harness

    names = [str(p) for p in write_harness_tasks(tmp_path / "tasks", rows=12).values()]
    out = tmp_path / "zero3"
    args = ["--model_config", json.dumps(TINY_TEST_MODEL), "--disable_tqdm", "true", "--synthetic_train_size", "64",
            "--synthetic_eval_size", "8", "--max_steps", "4", "--per_device_train_batch_size", "4",
            "--generation_eval", "false", "--report_to", "none", "--dataloader_num_workers", "0",
            "--eval_harness_tasks", json.dumps(names), "--output_dir", str(out)]  # fmt: skip
    result = launch("recipes/sft.py", args, accelerate_config="deepspeed_zero3.yaml",
                    launcher_args=("--num_processes", "2", "--mixed_precision", "no"))  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    harness = json.loads((out / "summary.json").read_text())["eval_harness"]
    assert harness["processes"] == 2 and set(harness["tasks"]) == {"tiny_choice", "tiny_reply", "tiny_rolling"}
    records = [r for r in _records(out) if any(k.startswith("harness/") for k in r)]
    assert len(records) == 1 and records[0]["step"] == 4  # written once, by the main process
    model, tokenizer = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    one = harness_figures(run_harness(model, tokenizer, names, batch_size=8))
    assert one == {k: v for k, v in records[0].items() if k != "step"}


def test_a_run_built_in_python_with_a_task_that_is_not_one_stops_at_its_start(tmp_path):
    from tunebook.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^eval_harness_tasks: .*missing\.yaml: no such task YAML file$"):
        _run("sft", tmp_path / "run", tmp_path / "cache", eval_harness_tasks=[str(tmp_path / "missing.yaml")])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # before anything trained or was written


# Every recipe that trains a causal LM gets the harness from the loop, with no code of its own (sft above, in full).
HARNESS_RECIPES = [
    n for n in RECIPES if n != "sft" and "eval_harness_tasks" in recipe_config_class(n).__dataclass_fields__
]


@pytest.mark.parametrize("name", HARNESS_RECIPES)
def test_every_causal_lm_recipe_reports_the_harness_figures_of_the_model_it_saves(name, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunebook.evaluation.harness import harness_figures, run_harness

    assert {"pretrain", "dpo", "kto", "grpo", "distill"} <= set(HARNESS_RECIPES)
    tasks = write_harness_tasks(tmp_path / "tasks", rows=8)
    names = [str(tasks["choice"])]
    summary = _run(name, tmp_path / "run", tmp_path / "cache", eval_harness_tasks=names, max_steps=2)
    final = [r for r in _records(tmp_path / "run") if "harness/tiny_choice/acc" in r]
    assert [r["step"] for r in final] == [2]
    assert summary["eval_harness"]["tasks"] == {"tiny_choice": {"acc": final[0]["harness/tiny_choice/acc"]}}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run")
    chat = summary["eval_harness"]["chat_template"]
    again = harness_figures(run_harness(model, tokenizer, names, batch_size=8, chat_template=chat))
    assert again == {k: v for k, v in final[0].items() if k != "step"}
