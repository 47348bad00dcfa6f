"""Reinforcement learning from rewards (GRPO): prompts, rollouts, reward functions, evaluation."""

from .prompts import PromptData, PromptRows, prepare_prompt_data, reference_examples, reward_inputs

__all__ = [
    "PromptData",
    "PromptRows",
    "prepare_prompt_data",
    "reference_examples",
    "reward_inputs",
]
