"""A library user who imports tunebook and calls `load_recipe("sft").main(config)` finds the process as it was.

The run happens in a fresh interpreter (tests/unit/side_effects_run.py, the state is taken before `import tunebook`),
so what an import registers counts too: the excepthook, IPython's error display, the root logger, Python's warnings
and garbage collector, `atexit` handlers, transformers' Llama code and dynamo's settings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("workers, extra", [(0, []), (2, []), (0, ["harness"])], ids=["0", "2", "harness"])
def test_a_run_from_python_leaves_the_process_as_it_was(tmp_path, workers, extra):
    script = Path(__file__).with_name("side_effects_run.py")
    result = subprocess.run([sys.executable, str(script), str(tmp_path), str(workers), *extra], capture_output=True,
                            text=True, cwd=ROOT, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = json.loads(result.stdout.splitlines()[-1])
    assert after["trained"], "the run did not train"
    del before["trained"], after["trained"]
    assert after == before  # atexit: counted after `import tunebook` and `load_recipe` (the run's workers add theirs)
