"""Tiny policies and rollouts the GRPO unit tests share (a plain module: test modules import it, not each other)."""

from __future__ import annotations

import torch
from support import TINY_TEST_MODEL

from tunebook.rl.grpo import Rollouts, rollout_rows

__all__ = ["policy", "rollouts", "tolerance"]


def policy(head: str, vocab: int = 64):
    """A tiny Llama whose output layer gives logits of a few units (an initialised one gives ~0.1, where tempering
    changes little): a plain linear head, one with a bias, or one the fused loss cannot take."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    settings = {k: v for k, v in TINY_TEST_MODEL.items() if k != "model_type"}
    model = LlamaForCausalLM(LlamaConfig(**settings, vocab_size=vocab))
    if head == "bias":
        model.lm_head = torch.nn.Linear(settings["hidden_size"], vocab, bias=True)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
        if head == "bias":
            model.lm_head.bias.normal_(0.0, 1.0)
    return model.eval()


def rollouts(prompt_ids, completions):
    rows = rollout_rows(prompt_ids, completions, 0, "cpu")
    return Rollouts(*rows, torch.zeros(len(completions)), None, None)


def tolerance(logits: torch.Tensor, temperature: float, hidden_size: int) -> float:
    """float32 rounding of logits / T (computed as (hidden / T) @ W where fused) and of the log-softmax: a few ulps
    of the largest tempered logit per term of the hidden_size-long dot product."""
    return 4 * hidden_size * torch.finfo(torch.float32).eps * float(logits.abs().max() / temperature + 1)
