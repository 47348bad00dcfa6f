"""Run recipes/sft.py unchanged and record, per process, during which micro-batch each gradient all-reduce ran, and
after which micro-batch each optimizer step.

Launched by test_launch.py through `accelerate launch` with 2 processes. DDP's all-reduces happen in C++, so a
communication hook counts them: it wraps the default all-reduce hook and notes how many backward passes had
started when it fired. Writes output_dir/allreduces-rank<N>.json.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import accelerate
import accelerate.optimizer
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

ROOT = Path(__file__).resolve().parents[2]
backward_passes = 0
allreduce_at: list[int] = []
step_at: list[int] = []

_prepare, _backward = accelerate.Accelerator.prepare, accelerate.Accelerator.backward
_step = accelerate.optimizer.AcceleratedOptimizer.step


def prepare(self, *args, **kwargs):
    prepared = _prepare(self, *args, **kwargs)
    for obj in prepared if isinstance(prepared, tuple) else (prepared,):
        if isinstance(obj, torch.nn.parallel.DistributedDataParallel):

            def hook(state, bucket):
                allreduce_at.append(backward_passes)
                return default_hooks.allreduce_hook(state, bucket)

            obj.register_comm_hook(None, hook)
    return prepared


def backward(self, loss, **kwargs):
    global backward_passes
    backward_passes += 1
    return _backward(self, loss, **kwargs)


def step(self, *args, **kwargs):
    if self.gradient_state.sync_gradients:  # Accelerate's optimizer steps only then
        step_at.append(backward_passes)
    return _step(self, *args, **kwargs)


accelerate.Accelerator.prepare, accelerate.Accelerator.backward = prepare, backward
accelerate.optimizer.AcceleratedOptimizer.step = step
if __name__ == "__main__":  # DataLoader workers import this script too (they come from a fork server)
    spec = importlib.util.spec_from_file_location("sft_recipe", ROOT / "recipes" / "sft.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    config = recipe.load_config(recipe.SFTConfig, sys.argv[1:])
    rank = int(os.environ["RANK"])
    recipe.main(config)
    record = {"backward_passes": backward_passes, "allreduce_at": allreduce_at, "step_at": step_at}
    (Path(config.output_dir) / f"allreduces-rank{rank}.json").write_text(json.dumps(record))
