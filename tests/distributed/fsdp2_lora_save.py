"""Save a LoRA checkpoint's adapter directory from an FSDP2-sharded model and from the same model unsharded.

Launched by test_launch.py through `tunebook train` with 2 CPU processes (gloo). Accelerate runs FSDP only on
GPUs, so the model is sharded here with torch's `fully_shard` on a CPU mesh, as Accelerate's FSDP2 plugin shards it
(each decoder layer, then the root), and the adapter directory is written by `save_checkpoint_adapter`, which the
checkpoint hook calls. Writes OUT/unsharded/ and OUT/sharded/ (each with adapter/ and base_model/).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from process_exit import exit_without_finalizing
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from tunebook.models.lora import save_checkpoint_adapter

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96, "tie_word_embeddings": False}  # fmt: skip


def lora_model():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", modules_to_save=["lm_head"]))
    with torch.no_grad():  # trained-looking adapters: lora_B starts at zero, which any wrong gather would also give
        for name, p in peft_model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return peft_model


def main(out: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model = lora_model()
    save_checkpoint_adapter(accelerator, model, out / "unsharded" / "adapter", out / "unsharded")
    accelerator.wait_for_everyone()

    model = lora_model()
    mesh = init_device_mesh("cpu", (accelerator.num_processes,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert type(model.base_model.model.lm_head.modules_to_save["default"].weight).__name__ == "DTensor"
    save_checkpoint_adapter(accelerator, model, out / "sharded" / "adapter", out / "sharded")
    accelerator.wait_for_everyone()
    exit_without_finalizing()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
