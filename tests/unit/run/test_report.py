from __future__ import annotations

import json
import logging

import pytest
import yaml
from support import assert_png

from tunebook.cli import main as cli
from tunebook.errors import ConfigError
from tunebook.run.record import finish_run
from tunebook.run.report import compare_runs, format_table, read_metrics, render_report


def _run_dir(path, learning_rate, losses, evals=((0, 3.0), (4, 1.5))):
    path.mkdir(parents=True)
    lines = [{"step": s, "eval_loss": v, "eval_accuracy": 1 / v, "eval_tokens": 10} for s, v in evals]
    for step, loss in enumerate(losses, start=1):
        lines.append({"step": step, "loss": loss, "learning_rate": learning_rate, "grad_norm": 1.0 / step,
                      "tokens_per_second": 1000.0 + step, "data_wait_fraction": 0.01, "train_tokens": 100 * step})  # fmt: skip
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 9, "lo')
    (path / "config.yaml").write_text(yaml.safe_dump({"learning_rate": learning_rate, "seed": 1, "max_steps": 4}))
    summary = {"recipe": "sft", "train_steps": 4, "final_train_loss": losses[-1], "eval": {"eval_loss": 1.5}}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_report_png_plots_every_panel_and_skips_a_line_cut_short(tmp_path):
    run = _run_dir(tmp_path / "a", 1e-3, [4.0, 3.0, 2.0, 1.0])
    train, evals = read_metrics(run)
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in evals] == [0, 4]
    assert_png(render_report([run], run / "report.png"))


def test_compare_runs_leads_with_the_config_keys_that_differ(tmp_path):
    a = _run_dir(tmp_path / "a", 1e-3, [4.0, 3.0, 2.0, 1.0])
    b = _run_dir(tmp_path / "b", 3e-4, [4.0, 3.5, 3.0, 2.5])
    lines = compare_runs([a, b]).splitlines()
    assert lines[0].split() == ["a", "b"]
    assert lines[2].split() == ["config.learning_rate", "0.001", "0.0003"]
    assert not any(line.startswith(("config.seed", "config.max_steps")) for line in lines)  # equal: not shown
    assert ["final_train_loss", "1", "2.5"] in [line.split() for line in lines]
    assert ["eval.eval_loss", "1.5", "1.5"] in [line.split() for line in lines]


def test_tunebook_report_command_renders_each_run_and_a_comparison(tmp_path, capsys):
    a = _run_dir(tmp_path / "a", 1e-3, [4.0, 3.0, 2.0, 1.0])
    b = _run_dir(tmp_path / "b", 3e-4, [4.0, 3.5, 3.0, 2.5])
    cli(["report", str(a), str(b), "--output", str(tmp_path / "both.png")])
    printed = capsys.readouterr().out
    assert "config.learning_rate" in printed and f"wrote {tmp_path / 'both.png'}" in printed
    for path in (a / "report.png", b / "report.png", tmp_path / "both.png"):
        assert_png(path)
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        cli(["report", str(tmp_path)])
    with pytest.raises(SystemExit):
        cli(["report"])


def test_finish_run_writes_the_summary_and_report_and_logs_a_table(tmp_path, caplog):
    run = _run_dir(tmp_path / "run", 1e-3, [4.0, 3.0, 2.0, 1.0])
    summary = {"recipe": "sft", "train_steps": 4, "train_tokens": 12345, "mfu": None, "versions": {"torch": "x"}}
    with caplog.at_level(logging.INFO, logger="tunebook"):
        finish_run(run, summary)
    assert json.loads((run / "summary.json").read_text()) == summary
    assert_png(run / "report.png")
    table = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Run summary:"))
    assert "train_tokens  12,345" in table and "versions" not in table


def test_format_table_aligns_columns_and_formats_numbers():
    table = format_table(["", "x", "y"], [["loss", 1.23456789, None], ["steps", 1000, 2], ["mfu", 0.00012345, True]])
    rows = [line.split() for line in table.splitlines()[2:]]
    assert rows == [["loss", "1.2346", "-"], ["steps", "1,000", "2"], ["mfu", "0.0001234", "true"]]
    widths = {len(line) for line in table.splitlines()[1:]}
    assert len(widths) == 1  # every row as wide as the rule: columns line up
