"""recipes/sft.py, where process $DISK_FULL_RANK's `torch.save` into the checkpoint of step $DISK_FULL_AT_STEP fails as
on a full disk (OSError ENOSPC): the other processes' writes succeed. Test scaffolding: it wraps the recipe from
outside, as `tunebook train tests/recipes/disk_full_at_save.py ...` (see signal_at_step.py)."""

import errno
import os

import torch

from tunebook import load_recipe
from tunebook.config import load_config

if __name__ == "__main__":
    sft = load_recipe("sft")
    save, folder = torch.save, f"step-{os.environ['DISK_FULL_AT_STEP']}.tmp"
    full_here = os.environ.get("RANK", "0") == os.environ.get("DISK_FULL_RANK", "0")

    def save_unless_full(obj, f, *args, **kwargs):
        if full_here and folder in str(f):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return save(obj, f, *args, **kwargs)

    torch.save = save_unless_full
    sft.main(load_config(sft.config_class))
