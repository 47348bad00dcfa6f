"""Every run logs its memory plan at the start and records it in summary.json; `per_device_train_batch_size: auto`
is resolved there, the same way the planner recommends."""

from __future__ import annotations

import json
import logging

import pytest
from recipe_runs import _run

from tunebook.recipe import RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_run_logs_its_plan_and_records_it_beside_the_measured_peak(recipe, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="tunebook"):
        summary = _run(recipe, tmp_path / "out", tmp_path / "cache", max_steps=2, log_level="INFO")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Memory plan:")]
    assert len(lines) == 1 and "GiB peak per device" in lines[0] and "activations" in lines[0]
    memory = json.loads((tmp_path / "out" / "summary.json").read_text())["memory"]
    assert memory == summary["memory"]
    assert 0 < memory["planned_allocated_gib"] <= memory["planned_peak_gib"] and memory["fits"]
    assert memory["measured_peak_allocated_gib"] is None and "CPU" in memory["measured_by"]  # no allocator stats


def test_auto_resolves_the_micro_batch_before_the_run_reads_it(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="tunebook"):
        _run("sft", tmp_path / "out", tmp_path / "cache", max_steps=2, log_level="INFO",
             per_device_train_batch_size="auto", gradient_accumulation_steps=2)  # fmt: skip
    chosen = [r.getMessage() for r in caplog.records if "per_device_train_batch_size auto:" in r.getMessage()]
    # This machine's memory holds the SFT default's 32 at once: the default, with the accumulation as given.
    assert chosen and chosen[0].startswith("per_device_train_batch_size auto: 32 (gradient_accumulation_steps 2)")
    saved = (tmp_path / "out" / "config.yaml").read_text()
    assert "per_device_train_batch_size: 32" in saved and "gradient_accumulation_steps: 2" in saved
