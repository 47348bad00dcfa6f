"""Reinforcement learning from rewards (GRPO): prompts, rollouts, reward functions, evaluation."""

from .prompts import PromptData, PromptRows, reference_examples, reward_inputs
from .vision_prompts import prepare_prompt_data

__all__ = [
    "PromptData",
    "PromptRows",
    "prepare_prompt_data",
    "reference_examples",
    "reward_inputs",
]
