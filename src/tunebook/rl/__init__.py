"""Reinforcement learning from rewards (GRPO): prompts, rollouts, reward functions, evaluation."""

from .episodes import load_episodes
from .prompts import PromptData, PromptRows, reference_examples, reward_inputs
from .vision_prompts import prepare_prompt_data

__all__ = [
    "PromptData",
    "PromptRows",
    "load_episodes",
    "prepare_prompt_data",
    "reference_examples",
    "reward_inputs",
]
