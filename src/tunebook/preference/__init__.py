"""Preference training (DPO and its variants) and reward models: pair data, losses, the reference
model, evaluation."""

from .data import (
    PreferenceData,
    prepare_preference_data,
    prompt_and_response,
    prompt_and_response_ids,
    write_synthetic_preferences,
)
from .evaluation import evaluate_preferences
from .losses import (
    LOSS_TYPES,
    REFERENCE_FREE_LOSSES,
    RewardStats,
    dpo_loss,
    policy_and_reference_log_probs,
    precompute_reference_log_probs,
    preference_loss,
    response_lengths,
    sequence_log_probs,
    weights_fingerprint,
)
from .reference import frozen_copy, partition_reference
from .reward import REWARD_FIGURES, RewardModel, bradley_terry_loss, load_reward_model, pair_rewards
from .reward_evaluation import evaluate_reward_model
from .vision_data import prepare_preference_or_vision_data, prepare_vision_preference_data

__all__ = [
    "LOSS_TYPES",
    "PreferenceData",
    "REFERENCE_FREE_LOSSES",
    "REWARD_FIGURES",
    "RewardModel",
    "RewardStats",
    "bradley_terry_loss",
    "dpo_loss",
    "evaluate_preferences",
    "evaluate_reward_model",
    "frozen_copy",
    "load_reward_model",
    "pair_rewards",
    "partition_reference",
    "policy_and_reference_log_probs",
    "precompute_reference_log_probs",
    "preference_loss",
    "prepare_preference_data",
    "prepare_preference_or_vision_data",
    "prepare_vision_preference_data",
    "prompt_and_response",
    "prompt_and_response_ids",
    "response_lengths",
    "sequence_log_probs",
    "weights_fingerprint",
    "write_synthetic_preferences",
]
