"""The weights an inference engine receives (`tunebook.rl.engine_weights`) from a sharded policy: every process
writes what it gathered, for a plain model and a LoRA one, next to the unsharded model's.

Launched by test_launch.py / test_deepspeed.py with 2 CPU processes (gloo): `fsdp2` shards with torch's
`fully_shard` on a CPU mesh (as Accelerate's FSDP2 plugin does, which runs only on GPUs); `zero3` is prepared by
Accelerate under accelerate_configs/deepspeed_zero3.yaml (DeepSpeed's CPU accelerator; the LoRA model only). Writes
OUT/<kind>/plain.safetensors (rank 0, unsharded) and OUT/<kind>/rank<i>.safetensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from process_exit import exit_without_finalizing
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from tunebook.rl.engine_weights import engine_weights

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96, "tie_word_embeddings": False}  # fmt: skip


def build(lora: bool):
    torch.manual_seed(0)
    # the class itself, not from_config: under a ZeRO-3 launch from_config builds inside deepspeed.zero.Init, whose
    # partitioning is collective, and rank 0 builds one more model than the others here
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}))
    if not lora:
        return model
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    with torch.no_grad():  # trained-looking adapters: lora_B starts at zero, which would hide a missing merge
        for name, p in peft_model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return peft_model


def plain_weights(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone().contiguous() for n, t in engine_weights(model)}


def main(kind: str, out: Path) -> None:
    accelerator = Accelerator(cpu=kind == "fsdp2")  # cpu=True would leave DeepSpeed out
    # ZeRO-3: one model per Accelerator (a second prepare trips over the batch sizes the first one set); the LoRA
    # model's gather covers the plain weights too (embeddings, norms, the base of every adapted layer)
    for lora in (False, True) if kind == "fsdp2" else (True,):
        name = "lora" if lora else "full"
        target = out / kind / name
        target.mkdir(parents=True, exist_ok=True)
        rank = torch.distributed.get_rank()  # (under this DeepSpeed-on-CPU launch Accelerate's own count says 1)
        if rank == 0:
            save_file(plain_weights(build(lora)), str(target / "plain.safetensors"))
        model = build(lora)
        if kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (accelerator.num_processes,))
            base = model.base_model.model if lora else model
            for layer in base.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            assert any(type(p).__name__ == "DTensor" for p in model.parameters())
        else:  # zero3: partitioned by the engine Accelerate prepares
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            ds = accelerator.state.deepspeed_plugin.deepspeed_config  # its batch sizes, which it checks at start
            ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                      train_batch_size=torch.distributed.get_world_size())  # fmt: skip
            model, optimizer = accelerator.prepare(model, optimizer)
            assert any(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())  # partitioned: empty
        save_file(plain_weights(model), str(target / f"rank{rank}.safetensors"))
        torch.distributed.barrier()
    exit_without_finalizing()


def same_as_unsharded(out, names=("full", "lora")) -> None:
    """(The test's check) every process gathered what the unsharded model gives, exactly."""
    from safetensors.torch import load_file

    for name in names:
        plain = load_file(out / name / "plain.safetensors")
        assert not any("lora" in k for k in plain) and "lm_head.weight" in plain
        for rank in (0, 1):
            gathered = load_file(out / name / f"rank{rank}.safetensors")
            assert sorted(gathered) == sorted(plain), name
            for key in plain:  # the same numbers gathered as held whole: no tolerance (one add of the same delta)
                torch.testing.assert_close(gathered[key], plain[key], rtol=0, atol=0, msg=f"{name} {key}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
