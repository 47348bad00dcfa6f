"""`eval_harness_tasks` in a causal-LM run: lm-evaluation-harness on the model in memory, before training, at each
evaluation and at the end, in metrics.jsonl, summary.json, the report and the model card; the figures at the end are
the saved model's."""

from __future__ import annotations

import importlib.util
import json

import pytest
from recipe_runs import _records, _run
from support import assert_png, write_harness_tasks

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

    card = (out / "README.md").read_text()
    assert "## Benchmarks" in card and "| tiny_choice | acc |" in card
    assert "model-index:" in card and "lm-evaluation-harness" in card
    assert_png(out / "report.png")
