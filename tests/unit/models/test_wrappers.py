"""`unwrap` finds the model accelerate's `extract_model_from_parallel` finds, without importing DeepSpeed."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.distributed as dist
from accelerate.utils import extract_model_from_parallel

from tunebook.models.wrappers import unwrap


def test_unwrap_equals_accelerates_for_each_wrapper(tmp_path):
    model = torch.nn.Linear(4, 2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        for wrapped in (model, torch.nn.DataParallel(model), ddp, torch.compile(ddp), torch.compile(model)):
            accelerates = extract_model_from_parallel(wrapped, keep_torch_compile=False)
            assert unwrap(wrapped) is accelerates is model
    finally:
        dist.destroy_process_group()


def test_unwrap_does_not_import_deepspeed():
    code = (
        "import sys, torch; from tunebook.models.wrappers import unwrap; "
        "m = torch.nn.Linear(2, 2); assert unwrap(torch.nn.DataParallel(m)) is m; "
        "assert 'deepspeed' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
