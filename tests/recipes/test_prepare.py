"""`tunebook prepare` builds exactly the caches a training run with the same config then uses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import ASSETS, ROOT, TINY_TEST_MODEL, launch

pytestmark = pytest.mark.slow
TUNEBOOK = str(Path(sys.executable).parent / "tunebook")
ARGS = [
    "--model_config", json.dumps(TINY_TEST_MODEL), "--disable_tqdm", "true", "--packing", "true",
    *"--max_seq_length 96 --synthetic_train_size 300 --synthetic_eval_size 20 --max_steps 2".split(),
]  # fmt: skip


def _tunebook(*args):
    return subprocess.run([TUNEBOOK, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_prepare_then_train_does_no_preprocessing(tmp_path):
    cache = tmp_path / "shared-cache"
    prepared = _tunebook("prepare", *ARGS, "--cache_dir", str(cache))
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    figures = dict(line.split(None, 1) for line in prepared.stdout.splitlines() if line.strip())
    assert int(figures["train_rows"]) > 0 and int(figures["train_tokens"]) > int(figures["train_rows"])
    assert 0.5 < float(figures["packing_efficiency"]) <= 1
    assert "train packing" in figures["built"]

    out = tmp_path / "run"
    result = launch("recipes/sft.py", [*ARGS, "--cache_dir", str(cache), "--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(all cached)" in result.stdout and "Tokenising" not in result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"]["train_rows"] == int(figures["train_rows"])
    assert summary["data_prep_seconds"] < summary["time_to_first_step_seconds"]
    assert 0 < summary["packing_efficiency"] <= 1

    again = _tunebook("prepare", *ARGS, "--cache_dir", str(cache))
    assert "nothing (all cached)" in again.stdout


def test_prepare_reports_user_errors_in_one_line(tmp_path):
    bad = _tunebook("prepare", "--pakcing", "true", "--cache_dir", str(tmp_path))
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "tunebook: error: unknown config key 'pakcing' (in command line); did you mean 'packing'?" in bad.stderr
    unknown = _tunebook("trian")
    assert unknown.returncode == 2 and "unknown command 'trian'" in unknown.stderr
    no_recipe = _tunebook("train", "--config_file", "accelerate_configs/cpu.yaml")
    assert no_recipe.returncode == 1 and no_recipe.stderr.startswith("tunebook: error: tunebook train needs a recipe")


def test_prepare_other_recipes_prints_a_stable_content_fingerprint(tmp_path):
    args = ["--recipe", "classify", "--cache_dir", str(tmp_path), "--synthetic_train_size", "200"]
    first, again = _tunebook("prepare", *args), _tunebook("prepare", *args)
    assert first.returncode == 0 and again.returncode == 0, first.stderr[-3000:]
    figures = [dict(line.split(None, 1) for line in r.stdout.splitlines() if line.strip()) for r in (first, again)]
    assert figures[0]["recipe"] == "classify" and int(figures[0]["train_rows"]) == 200
    assert figures[1]["built"] == "nothing (all cached)"
    assert figures[0]["train_fingerprint"] == figures[1]["train_fingerprint"]
    bad = _tunebook("prepare", "--recipe", "sfft")
    assert bad.returncode != 0 and "unknown recipe 'sfft'" in bad.stderr and "Traceback" not in bad.stderr


def test_prepare_dpo_pairs_and_a_file_without_pair_columns(tmp_path):
    result = _tunebook("prepare", "--recipe", "dpo", "--cache_dir", str(tmp_path), "--synthetic_train_size", "100")
    assert result.returncode == 0, result.stderr[-3000:]
    figures = dict(line.split(None, 1) for line in result.stdout.splitlines() if line.strip())
    assert figures["recipe"] == "dpo" and int(figures["train_rows"]) == 100 and int(figures["train_tokens"]) > 0
    bad = _tunebook(
        "prepare", "--recipe", "dpo", "--cache_dir", str(tmp_path), "--train_data", str(ASSETS / "alpaca.json")
    )
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "alpaca.json: preference data needs columns chosen and rejected" in bad.stderr
    assert "missing ['chosen', 'rejected']" in bad.stderr and len(bad.stderr.splitlines()) == 1
