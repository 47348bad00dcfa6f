"""The config of recipes/kto.py: Kahneman-Tversky Optimization on unpaired (prompt, completion, label) rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .checks import (
    MODEL_DATA_CHECKS,
    TRAINING_CHECKS,
    check_data_files,
    check_eval_harness,
    check_harness_tasks,
    check_sample_prompts,
)
from .fields import config_field, new_default
from .shared import CausalLMConfig, ChatModelConfig, fill_cache_dir, fill_tiny_model

__all__ = ["KTOConfig"]


@dataclass
class KTOConfig(CausalLMConfig, ChatModelConfig):
    """Kahneman-Tversky Optimization (Ethayarajh et al., 2024) of a causal LM on completions labelled desirable or
    undesirable: TRL's unpaired format (`prompt`, `completion`, `label` true/false), or preference pairs (`prompt`,
    `chosen`, `rejected`) split into one desirable and one undesirable row each. Keys are TRL's `KTOConfig` names.

    The defaults are the embedded offline run: the DPO default's generated digit-task pairs split into rows (the
    right answer desirable, a plausible wrong one undesirable), a locally trained tokenizer and a tiny Llama that a
    brief SFT warm-up on the desirable completions first teaches the task format.
    """

    # --- data
    overlong_examples: Literal["truncate", "drop"] = config_field(
        "Rows longer than max_seq_length: cut the completion to fit (the prompt is kept whole) or drop the row.",
        "truncate",
        section="data",
    )
    # --- KTO
    beta: float = config_field(
        "Strength of the KL penalty towards the reference model: the implicit reward is beta x the log-ratio of "
        "policy to reference, and the loss 1 - sigmoid(beta x (log-ratio - KL)) (TRL's default 0.1).",
        0.1,
        bounds="(0, inf)",
        section="training",
        common=True,
    )
    desirable_weight: float = config_field(
        "Weight of the desirable rows' losses (lambda_D). With unequal numbers of desirable and undesirable rows, "
        "the paper recommends desirable_weight x desirable rows / (undesirable_weight x undesirable rows) in "
        "[1, 4/3]; the run warns when neither weight is in that range.",
        1.0,
        bounds="(0, inf)",
        section="training",
        common=True,
    )
    undesirable_weight: float = config_field(
        "Weight of the undesirable rows' losses (lambda_U); see desirable_weight.",
        1.0,
        bounds="(0, inf)",
        section="training",
        common=True,
    )
    precompute_ref_log_probs: bool = config_field(
        "Compute the reference model's log-probabilities of every row and of its mismatched KL row once before "
        "training and cache them with the data (no reference forward, or second model, during training).",
        False,
        section="training",
    )
    sft_warmup_steps: int | None = config_field(
        "Optimizer steps of plain SFT on the desirable completions before KTO, for a model that has not learnt the "
        "task format; unset: 150 for a fresh model built from a config (the embedded default), 0 for a loaded one.",
        None,
        bounds="[0, inf)",
        section="training",
    )

    # The embedded default run (see the class docstring).
    output_dir: str = new_default("outputs/kto-default")
    max_seq_length: int = new_default(64, "Longest prompt + completion in tokens (a KL row too).")
    learning_rate: float = new_default(2e-3)
    warmup_ratio: float = new_default(0.1)
    per_device_train_batch_size: int | Literal["auto"] = new_default(
        32, "Rows per micro-batch per process (each with its mismatched KL row)."
    )
    per_device_eval_batch_size: int = new_default(128, "Rows per evaluation batch per process.")
    max_steps: int = new_default(100)
    logging_steps: int = new_default(10)
    synthetic_train_size: int = new_default(
        4000, "Preference pairs of the synthetic task, two rows each (when train_data is None)."
    )
    synthetic_eval_size: int = new_default(200, "Held-out pairs of the synthetic task, two rows each.")

    def __post_init__(self) -> None:
        fill_cache_dir(self)
        fill_tiny_model(self)
        if self.sft_warmup_steps is None:  # a fresh model (built from a config) warms up; a loaded one not
            self.sft_warmup_steps = 150 if self.model_name_or_path is None else 0

    def validate(self) -> None:
        for check in (*TRAINING_CHECKS, *MODEL_DATA_CHECKS, check_sample_prompts, check_eval_harness):
            check(self)

    def check_files(self) -> None:
        check_data_files(self)
        check_harness_tasks(self)
