"""Run by tests/unit/test_side_effects.py in a fresh interpreter: the process's state before `import tunebook` and
after a tiny in-process SFT run, as one JSON line `[before, after]`. Arguments: a work folder, the worker count."""

from __future__ import annotations

import atexit
import gc
import json
import logging
import sys
import warnings
from pathlib import Path


def state(trained: bool = False) -> dict:
    import matplotlib
    import matplotlib.pyplot as plt
    import torch._dynamo.config
    import transformers.models.llama.modeling_llama as llama
    from IPython.core.interactiveshell import InteractiveShell

    root = logging.getLogger()
    shell = InteractiveShell.instance()  # as in a notebook: `get_ipython()` finds it
    return {
        "trained": trained,
        "excepthook": repr(sys.excepthook),
        "root_handlers": [repr(h) for h in root.handlers],
        "root_level": root.level,
        "showwarning": repr(warnings.showwarning),
        "gc_enabled": gc.isenabled(),
        "gc_frozen": gc.get_freeze_count(),
        "atexit": atexit._ncallbacks(),
        "llama_rms_norm": repr(llama.LlamaRMSNorm.forward),
        "llama_attention": repr(llama.LlamaAttention.forward),
        "llama_rotary": repr(llama.apply_rotary_pos_emb),
        "suppress_errors": torch._dynamo.config.suppress_errors,
        "ipython_custom_exceptions": repr(shell.custom_exceptions),
        "ipython_display_hook": repr(sys.displayhook),
        "matplotlib_backend": matplotlib.get_backend(),  # a notebook's inline backend survives report.png
        "pyplot_figures": plt.get_fignums(),
    }


def main(work: str, workers: int, harness: bool = False) -> None:
    import os

    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TUNEBOOK_CACHE=work)
    # The libraries a run uses register their own exit handlers (and a logger or two) when imported: theirs, not ours.
    import accelerate  # noqa: F401
    import datasets  # noqa: F401
    import matplotlib
    import matplotlib.pyplot  # noqa: F401
    import peft  # noqa: F401
    import torch._inductor.config  # noqa: F401
    import transformers  # noqa: F401

    matplotlib.use("svg")  # not Agg, as a notebook's `%matplotlib inline` is not
    before = state()
    from support import TINY_TEST_MODEL, write_harness_tasks

    from tunebook import load_recipe

    sft = load_recipe("sft")
    imported = atexit._ncallbacks()  # nothing registered by importing tunebook and the recipe
    config = sft.config(model_config=TINY_TEST_MODEL, synthetic_train_size=32, synthetic_eval_size=8, max_steps=2,
                        per_device_train_batch_size=4, disable_tqdm=True, report_to="none", eval_on_start=False,
                        generation_eval=False, dataloader_num_workers=workers, output_dir=f"{work}/out",
                        cache_dir=f"{work}/cache")  # fmt: skip
    if harness:  # lm-evaluation-harness at the end (lm-eval imported by the run, as a user's config asks)
        config.eval_harness_tasks = [str(write_harness_tasks(Path(work) / "tasks", rows=4)["choice"])]
    sft.main(config)
    after = state(trained=(Path(work) / "out" / "metrics.jsonl").is_file())
    # The run's own exit handlers (the libraries' for its DataLoader workers and ours that kills them, should one be
    # held at exit) are counted apart: what importing registers must be nothing.
    before["atexit"], after["atexit"] = before["atexit"], imported
    print(json.dumps([before, after]))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["harness"])
