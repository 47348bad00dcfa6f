"""Two fp16 updates of an FSDP2-sharded model, where only rank 1's shard of one gradient overflows in the first.

Launched by test_launch.py through `tunebook train` with 2 CPU processes (gloo). Under FSDP2 Accelerate uses
torch's plain `GradScaler`, not FSDP1's `ShardedGradScaler`, so each rank checks only its own gradient shards: the
loop's skip (`optimizer_step_or_skip`) is right only if the overflow found on one rank reaches every rank (DTensor's
found-inf reduction). The model is sharded with `fully_shard` on a CPU mesh, as in fsdp2_lora_save.py. Writes
OUT/rank{N}.json: per update, whether the loop took it, the loss scale after it, and whether the weights changed.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from accelerate import Accelerator
from accelerate.utils.fsdp_utils import get_fsdp2_grad_scaler
from process_exit import exit_without_finalizing
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tunebook.training.step import optimizer_step_or_skip


def main(out: Path) -> None:
    accelerator = Accelerator(cpu=True)
    # What Accelerate builds for fp16 under FSDP2 (on a GPU; on a CPU it builds none): set before `prepare`, so the
    # prepared optimizer steps through it and `backward` scales the loss.
    accelerator.scaler, accelerator.native_amp = get_fsdp2_grad_scaler(device="cpu"), True
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (accelerator.num_processes,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=0.1))
    run = SimpleNamespace(config=SimpleNamespace(nan_policy="stop"), accelerator=accelerator, log=logging.getLogger(),
                          stop=None)  # fmt: skip
    state = SimpleNamespace(global_step=0, skipped_updates=0)
    updates = []
    for overflow in (True, False):
        loss = model(torch.randn(4, 8)).sum()
        accelerator.backward(loss)
        if overflow and accelerator.process_index == 1:
            model[0].weight.grad.to_local()[0, 0] = float("inf")
        before = [p.full_tensor().clone() for p in model.parameters()]
        updated = optimizer_step_or_skip(run, state, optimizer, finite=True)  # the loss is finite: the scaler's
        changed = any(not torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
        updates.append({"updated": updated, "scale": accelerator.scaler.get_scale(), "weights_changed": changed})
        optimizer.zero_grad(set_to_none=True)
        state.global_step += 1
    record = {"updates": updates, "skipped_updates": state.skipped_updates,
              "scaler": type(accelerator.scaler).__name__, "sharded": type(model[0].weight).__name__}  # fmt: skip
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
    exit_without_finalizing()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
