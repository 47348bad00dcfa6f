"""A brief SFT warm-up before preference or RL training, for a model that has not learnt the task's format."""

from __future__ import annotations

import logging

import datasets
import torch

from ..data.collate import PadCollator
from ..data.loaders import build_loader
from ..models.attention import image_inputs
from .loss import causal_lm_token_losses
from .optim import build_optimizer, build_scheduler

__all__ = ["sft_warmup"]


def sft_warmup(model, examples: datasets.Dataset, pad_token_id: int, *, steps: int, batch_size: int, seed: int,
               device, log: logging.Logger, learning_rate: float = 3e-3, lr_scheduler_type: str = "constant",
               max_grad_norm: float | None = None, pad_to_multiple_of: int | None = None,
               collate_fn=None) -> None:  # fmt: skip
    """`steps` optimizer steps of plain SFT (token-mean loss, AdamW; optionally a schedule with 5% warm-up and
    gradient clipping) on `examples` (input_ids, labels), before `accelerator.prepare`: every process runs the same
    steps on the same data from the same seed, and DDP then starts all replicas from rank 0's weights. Its
    optimizer is its own and is dropped afterwards. `collate_fn` replaces `PadCollator` (a vision-language model's
    `VisionCollator`, whose image inputs reach the model)."""
    collate_fn = collate_fn or PadCollator(pad_token_id, pad_to_multiple_of)
    loader = build_loader(examples, batch_size, shuffle=True, seed=seed, num_workers=0, collate_fn=collate_fn)
    optimizer = build_optimizer(model, learning_rate, 0.0, (0.9, 0.999), 1e-8)
    schedule = build_scheduler(lr_scheduler_type, optimizer, steps, 0.05)
    model.to(device).train()
    step = 0
    while step < steps:
        for batch in loader:  # a new order each epoch, from the loader's own seeded generator
            batch = {k: v.to(device) for k, v in batch.items()}
            inputs = {
                "input_ids": batch["input_ids"],
                "attention_mask": batch["attention_mask"],
                **image_inputs(batch),
            }
            losses = causal_lm_token_losses(model, inputs, batch)[0]
            losses.mean().backward()
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0 or step == steps:
                log.info("SFT warm-up step %d/%d: loss %.4f", step, steps, losses.mean().item())
            if step == steps:
                break
