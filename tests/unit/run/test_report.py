from __future__ import annotations

import json
import logging

import pytest
import yaml
from support import assert_png

from tunebook.cli import main as cli
from tunebook.errors import ConfigError
from tunebook.run.record import finish_run
from tunebook.run.report import _tick, compare_runs, format_table, read_metrics, render_report, report_figure


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


def test_finish_run_writes_the_summary_and_report_and_ends_with_a_headline_not_a_table(tmp_path, caplog):
    run = _run_dir(tmp_path / "run", 1e-3, [4.0, 3.0, 2.0, 1.0])
    (run / "config.json").write_text("{}")  # a saved model: the headline says how to load it
    summary = {"recipe": "sft", "train_steps": 4, "train_tokens": 12345, "train_runtime_seconds": 3.25, "mfu": None, "versions": {"torch": "x"},
               "attention_span": 27.8, "output_dir": "outputs/run", "eval": {"eval_exact_match": 0.75},
               "eval_before_training": {"eval_exact_match": 0.0}}  # fmt: skip
    with caplog.at_level(logging.DEBUG, logger="tunebook"):
        finish_run(run, summary, metric=("eval_exact_match", "exact match", ".3f"), wall_seconds=75)
    assert json.loads((run / "summary.json").read_text()) == summary
    assert_png(run / "report.png")
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert info[0] == "Trained 4 steps in 3.2 s (1 min 15 s in all)"
    assert info[1:] == [
        "Eval exact match: 0.000 before training -> 0.750 after",
        "Outputs in outputs/run: the model and tokenizer, summary.json (every figure), report.png (the curves), "
        "README.md (the model card)",
        'Load it: from transformers import AutoModelForCausalLM; model = AutoModelForCausalLM.from_pretrained("outputs/run")',
    ]
    assert not any("attention_span" in line or "Run summary" in line for line in info)  # the table is gone
    # ... from the console: with log_level DEBUG the whole summary is still a table in the log
    table = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Run summary:"))
    assert ["train_tokens", "12,345"] in [line.split() for line in table.splitlines()] and "versions" not in table
    assert next(r for r in caplog.records if r.getMessage().startswith("Run summary:")).levelno == logging.DEBUG


def _panel(figure, title):
    return next(ax for ax in figure.axes if ax.get_title() == title)


def test_the_learning_rate_starts_at_step_0_with_the_schedules_first_value(tmp_path):
    run = _run_dir(tmp_path / "warm", 1e-3, [4.0, 3.0, 2.0, 1.0])
    (run / "config.yaml").write_text(yaml.safe_dump({"learning_rate": 1e-3, "warmup_ratio": 0.5}))
    steps, rates = _panel(report_figure([run]), "Learning rate").get_lines()[0].get_data()
    assert list(steps) == [0, 1, 2, 3, 4] and list(rates) == [0.0, 1e-3, 1e-3, 1e-3, 1e-3]  # the warm-up's start
    (run / "config.yaml").write_text(yaml.safe_dump({"learning_rate": 1e-3, "warmup_ratio": 0.5,
                                                     "lr_scheduler_type": "constant"}))  # fmt: skip
    steps, rates = _panel(report_figure([run]), "Learning rate").get_lines()[0].get_data()
    assert list(steps)[:2] == [0, 1] and rates[0] == 1e-3  # `constant` has no warm-up
    (run / "config.yaml").unlink()
    steps, _ = _panel(report_figure([run]), "Learning rate").get_lines()[0].get_data()
    assert list(steps) == [1, 2, 3, 4]  # no config: nothing made up


def test_a_resumed_run_is_marked_where_it_continued(tmp_path):
    run = _run_dir(tmp_path / "resumed", 1e-3, [4.0, 3.0, 2.0, 1.0])
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "resumed_from": str(run / "checkpoints" / "step-2")}))
    figure = report_figure([run])
    for ax in figure.axes:
        markers = [line for line in ax.get_lines() if line.get_label() == "resumed"]
        assert [list(line.get_xdata()) for line in markers] == [[2, 2]], ax.get_title()
    assert "resumed" in [t.get_text() for t in _panel(figure, "Loss").get_legend().get_texts()]
    plain = _run_dir(tmp_path / "plain", 1e-3, [4.0, 3.0, 2.0, 1.0])
    assert not any(line.get_label() == "resumed" for ax in report_figure([plain]).axes for line in ax.get_lines())


def test_a_flat_series_gets_a_range_around_it_and_ticks_without_offset(tmp_path):
    run = _run_dir(tmp_path / "flat", 1e-4, [4.0, 3.0, 2.0, 1.0], evals=((0, 3.0), (4, 3.0)))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[:-1]]
    for r in records:
        r.update({"grad_norm": 1.0} if "loss" in r else {"eval_exact_match": 0.0, "eval_accuracy": 0.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    figure = report_figure([run])
    figure.canvas.draw()  # tick labels and offset texts are made when drawn, on the figure's own Agg canvas
    assert _panel(figure, "Gradient norm (before clipping)").get_ylim() == (0.5, 1.5)
    scores = _panel(figure, "Eval metrics")
    assert scores.get_ylim() == (-0.05, 1.0)  # a flat 0 (exact match, accuracy): 0 to 1, not ±0.04
    labels = [t.get_text() for t in scores.get_yticklabels()]
    assert {"0", "0.2", "1"} <= set(labels) and not {"0.04", "-0.04"} & set(labels), labels
    for ax in figure.axes:
        assert ax.yaxis.get_offset_text().get_text() == "", ax.get_title()  # no "1e-5" or "+1" above an axis
    rates = [t.get_text() for t in _panel(figure, "Learning rate").get_yticklabels()]
    assert "1e-4" in rates and all("e+" not in t and "−" not in t for t in rates), rates


def test_ticks_read_as_numbers():
    assert [_tick(v, 0, 1) for v in (0, 0.25, 1e-17)] == ["0", "0.25", "0"]
    assert [_tick(v, 0, 3e-3) for v in (5e-4, 1.5e-3, 3e-3)] == ["5e-4", "1.5e-3", "3e-3"]  # one kind per axis
    assert [_tick(v, 0, 20000) for v in (12500, 2.5)] == ["12,500", "2.5"]
    assert _tick(2e6, 0, 3e6) == "2e6"


def test_the_report_leaves_the_backend_and_pyplot_as_they_were(tmp_path):
    """A notebook's `%matplotlib inline` survives `main(config)`: the report draws on a Figure of its own."""
    import matplotlib
    import matplotlib.pyplot as plt

    run = _run_dir(tmp_path / "a", 1e-3, [4.0, 3.0, 2.0, 1.0])
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # a backend other than Agg, as a notebook's inline one is
    try:
        mine = plt.figure()
        render_report([run], run / "report.png")
        assert matplotlib.get_backend() == "svg" and matplotlib.rcParams["backend"] == "svg"
        assert plt.get_fignums() == [mine.number] and plt.gcf() is mine  # no figure added, closed or made current
        plt.close(mine)
    finally:
        matplotlib.use(before)
    assert_png(run / "report.png")


def test_format_table_aligns_columns_and_formats_numbers():
    table = format_table(["", "x", "y"], [["loss", 1.23456789, None], ["steps", 1000, 2], ["mfu", 0.00012345, True]])
    rows = [line.split() for line in table.splitlines()[2:]]
    assert rows == [["loss", "1.2346", "-"], ["steps", "1,000", "2"], ["mfu", "0.0001234", "true"]]
    widths = {len(line) for line in table.splitlines()[1:]}
    assert len(widths) == 1  # every row as wide as the rule: columns line up


def test_the_eval_panel_plots_the_harness_figures_beside_the_run_s_own(tmp_path):
    run = _run_dir(tmp_path / "harness", 1e-3, [4.0, 3.0, 2.0, 1.0])
    with open(run / "metrics.jsonl", "a") as f:  # after the line cut short, as a resumed run appends
        f.write('\n{"step": 0, "harness/arc_easy/acc": 0.25}\n{"step": 4, "harness/arc_easy/acc": 0.5}\n')
    lines = {line.get_label(): line.get_data() for line in _panel(report_figure([run]), "Eval metrics").get_lines()}
    assert set(lines) == {"accuracy", "arc_easy/acc"}
    assert [list(v) for v in lines["arc_easy/acc"]] == [[0, 4], [0.25, 0.5]]
