"""Every notebook is stored without outputs and runs top to bottom offline in a fresh kernel (nbclient)."""

from __future__ import annotations

import time

import nbformat
import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_four_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb",
        "02_multi_process.ipynb",
        "03_classification.ipynb",
        "04_sft_reward_grpo.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name} is stored with outputs"
    start = time.monotonic()
    # The kernel inherits this process's environment: HF_HUB_OFFLINE=1 and the session's TUNEBOOK_CACHE.
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    assert time.monotonic() - start < 180, f"{path.name} took {time.monotonic() - start:.0f} s (budget: 3 minutes)"
    text = "\n".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.outputs)
    if path.stem == "02_multi_process":
        assert "2 processes" in text
