"""`tunebook evaluate MODEL_DIR --tasks ...`: the harness on a saved model, its figures printed and written, the
same on two processes as on one (every request's answer, bit for bit), and one line for what it cannot evaluate."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from support import ROOT, free_port, write_harness_tasks

if importlib.util.find_spec("lm_eval") is None:  # not importorskip: lm-eval is imported as tunebook imports it
    pytest.skip('lm-evaluation-harness is not installed: pip install "tunebook[eval]"', allow_module_level=True)

from tunebook import cli  # noqa: E402
from tunebook.errors import ConfigError  # noqa: E402


def _evaluate(model_dir, tasks, out, *extra) -> dict:
    cli.main(["evaluate", str(model_dir), "--tasks", *map(str, tasks), "--output", str(out), *extra])
    return json.loads(out.read_text())


def test_evaluate_prints_and_writes_the_figures(tiny_chat_model_dir, tmp_path, capsys):
    tasks = write_harness_tasks(tmp_path / "tasks", rows=10)
    written = _evaluate(tiny_chat_model_dir, [tasks["choice"], tasks["reply"]], tmp_path / "scores.json")
    printed = capsys.readouterr().out
    assert set(written["tasks"]) == {"tiny_choice", "tiny_reply"} and written["documents"]["tiny_choice"] == 10
    acc = written["tasks"]["tiny_choice"]["acc"]
    assert f"tiny_choice  acc          {acc:.4f}" in printed and f"wrote {tmp_path / 'scores.json'}" in printed
    assert written["chat_template"] is True and written["model"] == str(tiny_chat_model_dir)


def test_what_it_cannot_evaluate_is_one_line(tiny_chat_model_dir, tmp_path):
    tasks = write_harness_tasks(tmp_path / "tasks", rows=3)
    with pytest.raises(ConfigError, match=r"is not a directory: give a model directory"):
        cli.main(["evaluate", str(tmp_path / "nowhere"), "--tasks", str(tasks["choice"])])
    with pytest.raises(ConfigError, match=r"^--tasks: .*nope\.yaml: no such task YAML file$"):
        cli.main(["evaluate", str(tiny_chat_model_dir), "--tasks", str(tmp_path / "nope.yaml")])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_give_every_answer_one_process_gives(tiny_chat_model_dir, tmp_path):
    tasks = [*write_harness_tasks(tmp_path / "tasks", rows=30).values()]
    one = _evaluate(tiny_chat_model_dir, tasks, tmp_path / "one.json", "--log_samples", "--batch_size", "7")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--quiet", "--config_file",
               str(ROOT / "accelerate_configs" / "multi_cpu.yaml"), "--main_process_port", str(free_port()), "-m",
               "tunebook.cli", "evaluate", str(tiny_chat_model_dir), "--tasks", *map(str, tasks), "--output",
               str(tmp_path / "two.json"), "--log_samples", "--batch_size", "7"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    two = json.loads((tmp_path / "two.json").read_text())
    assert (one["processes"], two["processes"]) == (1, 2)
    assert two["tasks"] == one["tasks"] and two["documents"] == one["documents"]
    for task in ("tiny_choice", "tiny_reply"):
        answers = [[s["doc_id"], s["resps"]] for s in one["samples"][task]]
        assert [[s["doc_id"], s["resps"]] for s in two["samples"][task]] == answers
