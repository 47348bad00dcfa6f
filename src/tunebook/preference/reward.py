"""Reward models: a sequence classifier with one output, the reward, trained on preference pairs with the
Bradley-Terry loss, and a trained one loaded as a scoring function (a GRPO reward).

Under the Bradley-Terry model the chosen response is preferred with probability sigmoid(r_chosen - r_rejected), so
the loss of a pair is -log sigmoid(r_chosen - r_rejected - margin), with `margin` from the data when it says how much
better the chosen response is (Llama 2's reward models; 0 otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["REWARD_FIGURES", "RewardModel", "bradley_terry_loss", "load_reward_model", "pair_rewards"]

# The logged names (TRL's RewardTrainer's) of the means of loss, chosen and rejected rewards, accuracy and margin.
REWARD_FIGURES = ("loss", "rewards/chosen", "rewards/rejected", "accuracy", "margin")


def pair_rewards(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reward of every row of a pair batch (B chosen, then B rejected), float32, shape (2B,): one forward."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0].float()


def bradley_terry_loss(
    rewards: torch.Tensor, margin: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses -log sigmoid(r_chosen - r_rejected - margin) of `rewards` (2B rows, chosen then rejected),
    and the (detached) chosen and rejected rewards."""
    half = rewards.shape[0] // 2
    chosen, rejected = rewards[:half], rewards[half:]
    difference = chosen - rejected if margin is None else chosen - rejected - margin.to(rewards.dtype)
    return -F.logsigmoid(difference), chosen.detach(), rejected.detach()


class RewardModel:
    """`score(prompts, completions, **columns) -> list[float]`: a trained reward model's reward for each prompt and
    completion, formatted as the reward recipe formats a pair (see `load_reward_model`)."""

    def __init__(self, model, tokenizer, device, batch_size: int, max_length: int | None):
        self.__name__ = "reward_model"  # how a GRPO run names this reward in its logs, as it names a function
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.batch_size, self.max_length = batch_size, max_length

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float]:
        from ..data.collate import PadCollator
        from .data import encode_texts, prompt_and_response, prompt_and_response_texts

        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        tools = columns.get("tools") or [None] * len(prompts)
        texts = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            where = f"reward model input {i + 1}"
            prompt, response = prompt_and_response(prompt, completion, where)
            row_tools = json.loads(tools[i]) if isinstance(tools[i], str) else tools[i]  # as a pair's tools column
            prompt_text, (response_text,) = prompt_and_response_texts(
                self.tokenizer, prompt, [response], row_tools, where
            )
            texts += [prompt_text, response_text]
        ids = encode_texts(self.tokenizer, texts)
        rows = []
        for prompt_ids, response_ids in zip(ids[::2], ids[1::2]):
            if self.max_length is not None:  # as training cut pairs: the prompt whole, the response's end dropped
                response_ids = response_ids[: max(self.max_length - len(prompt_ids), 0)]
            rows.append({"input_ids": prompt_ids + response_ids, "labels": prompt_ids + response_ids})
        collate = PadCollator(self.tokenizer.pad_token_id)
        scores = []
        for start in range(0, len(rows), self.batch_size):
            batch = {k: v.to(self.device) for k, v in collate(rows[start : start + self.batch_size]).items()}
            scores += pair_rewards(self.model, batch).tolist()
        return scores


def load_reward_model(
    path: str | Path,
    device: str | torch.device | None = None,
    batch_size: int = 32,
    max_length: int | None = None,
    use_safetensors: bool = True,
    trust_remote_code: bool = False,
) -> RewardModel:
    """A reward model directory (the reward recipe's output, or any `AutoModelForSequenceClassification` with one
    output and a tokenizer with a chat template) as `score(prompts, completions, **columns) -> list[float]`.

    A prompt is a string (one user message) or a list of chat messages; a completion a string (the assistant's
    answer), a list of messages, or a whole conversation that repeats the prompt. Each is rendered with the
    tokenizer's chat template and tokenised as the reward recipe tokenises a pair, then scored in eval mode without
    gradients, `batch_size` rows at a time (right-padded; the reward is read at each row's last token). A `tools`
    column is rendered as in training. `max_length` cuts responses so prompt + response fit, as training did.

    Args:
        path: the model directory.
        device: where the model runs (default: CPU).
        batch_size: rows per forward pass.
        max_length: longest prompt + response in tokens (None: no cut).
        use_safetensors: load weights only from safetensors files (pickled weights can run code when loaded).
        trust_remote_code: allow the directory's own Python code (a custom architecture) to run.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from ..errors import ModelError
    from ..models.build import refuse_pickled_weights

    refuse_pickled_weights(path, use_safetensors)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, use_safetensors=use_safetensors, trust_remote_code=trust_remote_code
    )
    if model.config.num_labels != 1:
        raise ModelError(f"{path}: a reward model has one output; this one has {model.config.num_labels} labels")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:  # the classifier finds each row's last token by it
        model.config.pad_token_id = tokenizer.pad_token_id
    device = torch.device(device or "cpu")
    return RewardModel(model.to(device).eval().requires_grad_(False), tokenizer, device, batch_size, max_length)
