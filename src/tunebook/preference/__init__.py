"""Preference training (DPO and its variants, KTO) and reward models: pair and unpaired data, losses, the reference
model, evaluation."""

from .data import (
    PreferenceData,
    prepare_preference_data,
    prompt_and_response,
    prompt_and_response_ids,
    write_synthetic_preferences,
)
from .evaluation import evaluate_preferences
from .kto import KTOStats, evaluate_kto, kto_loss, precompute_kto_reference, step_kl_and_reference
from .kto_data import KTOCollator, KTOData, kl_batch, mismatched_partners, prepare_kto_data, with_kl_rows
from .losses import (
    LOSS_TYPES,
    REFERENCE_FREE_LOSSES,
    RewardStats,
    dpo_loss,
    policy_and_reference_log_probs,
    precompute_reference_log_probs,
    preference_loss,
    reference_log_probs,
    response_lengths,
    sequence_log_probs,
    weights_fingerprint,
)
from .reference import frozen_copy, partition_reference
from .reward import REWARD_FIGURES, RewardModel, bradley_terry_loss, load_reward_model, pair_rewards
from .reward_evaluation import evaluate_reward_model
from .vision_data import prepare_preference_or_vision_data, prepare_vision_preference_data

__all__ = [
    "KTOCollator",
    "KTOData",
    "KTOStats",
    "LOSS_TYPES",
    "PreferenceData",
    "REFERENCE_FREE_LOSSES",
    "REWARD_FIGURES",
    "RewardModel",
    "RewardStats",
    "bradley_terry_loss",
    "dpo_loss",
    "evaluate_kto",
    "evaluate_preferences",
    "evaluate_reward_model",
    "frozen_copy",
    "kl_batch",
    "kto_loss",
    "load_reward_model",
    "mismatched_partners",
    "pair_rewards",
    "partition_reference",
    "policy_and_reference_log_probs",
    "precompute_kto_reference",
    "precompute_reference_log_probs",
    "preference_loss",
    "prepare_kto_data",
    "prepare_preference_data",
    "prepare_preference_or_vision_data",
    "prepare_vision_preference_data",
    "prompt_and_response",
    "prompt_and_response_ids",
    "reference_log_probs",
    "response_lengths",
    "sequence_log_probs",
    "step_kl_and_reference",
    "weights_fingerprint",
    "with_kl_rows",
    "write_synthetic_preferences",
]
