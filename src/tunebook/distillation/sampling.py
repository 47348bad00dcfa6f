"""Completions sampled for distillation: GKD's on-policy steps (the student samples, a share `lmbda` of the steps) and
sequence-level KD (the teacher samples), through the RL generation backends (`tunebook.rl.generation`), so a batch's
completions come from whichever engine the backend runs.

A batch's prompts are its rows up to their first loss-bearing token (the data's own completion follows there, and
the chat template's assistant header before it stays in the prompt); each sampled completion, up to and including its
stop token, replaces the data's and carries the loss. Every completion has a seed of its own, from the run's seed,
the optimizer step, the micro-batch, the process and the row, so a resumed run samples what the uninterrupted one did.
"""

from __future__ import annotations

import random

import torch

from ..data.collate import PadCollator
from ..data.tokenize import IGNORE_INDEX
from ..evaluation.generate import stop_token_ids
from ..rl.generation import GenerationBackend, Sampling, stop_id_tuple
from ..rl.grpo import completion_seed

__all__ = ["batch_prompts", "completion_sampling", "is_on_policy_step", "sampled_batch"]


def is_on_policy_step(seed: int, step: int, lmbda: float) -> bool:
    """Whether optimizer step `step` trains on the student's own samples: true for a share `lmbda` of the steps,
    decided by the seed and the step alone (the same on every process, and again after a resume). Per optimizer step
    rather than per micro-batch (TRL): k accumulated micro-batches are then one batch of their union."""
    # A string seed goes through SHA-512: integer seeds of consecutive steps gave correlated first draws (seed 42:
    # steps 0-10 all off-policy at lmbda 0.5).
    return lmbda > 0 and random.Random(f"distill-on-policy-{seed}-{step}").random() < lmbda


def batch_prompts(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    """Each row's tokens before its first loss-bearing one (a row without any: all its tokens), at least one."""
    labels, ids = batch["labels"].cpu(), batch["input_ids"].cpu()
    lengths = batch["attention_mask"].sum(dim=1).cpu()
    prompts = []
    for row in range(len(ids)):
        where = (labels[row] != IGNORE_INDEX).nonzero()
        end = int(where[0]) if len(where) else int(lengths[row])
        prompts.append(ids[row, : max(end, 1)].tolist())  # plain text: its first token (the loss never predicts it)
    return prompts


def completion_sampling(config, model, tokenizer) -> Sampling:
    """How completions are sampled: at `temperature` (the loss's), at most `max_new_tokens`, until a stop token of
    the model's (`stop_token_ids`: the chat template's end of turn too)."""
    stops = stop_id_tuple(stop_token_ids(model, tokenizer))
    return Sampling(
        config.max_new_tokens, config.temperature, stop_token_ids=stops, pad_token_id=tokenizer.pad_token_id
    )


def sampled_batch(backend: GenerationBackend, batch: dict[str, torch.Tensor], sampling: Sampling, config, step: int,
                  micro: int, process: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """`batch` with each row's completion sampled by `backend` from its prompt, padded as the data's batches are
    (`pad_to_multiple_of`), on their device. A row is cut at `max_seq_length` tokens, as the data's are. `step`,
    `micro` (the micro-batch in the step) and `process` pick the seeds, with `config.seed`."""
    prompts = batch_prompts(batch)
    seeds = [completion_seed(config.seed, step, process * 65_536 + micro, row) for row in range(len(prompts))]
    generated = backend.generate(prompts, seeds, sampling)
    rows = []
    for prompt, completion in zip(prompts, generated.token_ids):
        completion = list(completion)[: max(0, config.max_seq_length - len(prompt))]
        rows.append({"input_ids": prompt + completion, "labels": [IGNORE_INDEX] * len(prompt) + completion})
    collate = PadCollator(sampling.pad_token_id, config.pad_to_multiple_of)
    return {k: v.to(batch["input_ids"].device) for k, v in collate(rows).items()}
