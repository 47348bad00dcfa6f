"""The config of recipes/dpo.py: Direct Preference Optimization (and SimPO, ORPO, ...) on preference pairs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .checks import (
    MODEL_DATA_CHECKS,
    TRAINING_CHECKS,
    check_data_files,
    check_eval_harness,
    check_harness_tasks,
    check_label_smoothing,
    check_reference_to_precompute,
    check_rpo_alpha,
    check_sample_prompts,
)
from .fields import config_field, new_default
from .shared import CausalLMConfig, ChatModelConfig, fill_cache_dir, fill_tiny_model
from .vision import VisionConfig, check_image_dir, check_vision_keys

__all__ = ["DPOConfig"]


@dataclass
class DPOConfig(CausalLMConfig, VisionConfig, ChatModelConfig):
    """Direct Preference Optimization of a causal LM on (prompt, chosen, rejected) pairs; a vision-language model's
    pairs carry images (the `VisionConfig` keys; recipes/configs/dpo/vlm_default.yaml).

    The defaults are the embedded offline run: generated preference pairs over the SFT default's digit task (the
    correct answer chosen, a plausible wrong one rejected), a locally trained tokenizer and a tiny Llama that a
    brief SFT warm-up on the chosen answers first teaches the task format.
    """

    # --- data
    overlong_examples: Literal["truncate", "drop"] = config_field(
        "Pairs longer than max_seq_length: cut the responses to fit (the prompt is kept whole) or drop the pair.",
        "truncate",
        section="data",
    )
    # --- DPO
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo"] = config_field(
        "The preference loss, TRL's formulas (but see label_smoothing, rpo_alpha and orpo): sigmoid (DPO), ipo, hinge "
        "(SLiC), robust (rDPO), or, with no reference model at all, simpo (SimPO, length-normalised, margin "
        "simpo_gamma) or orpo (odds ratio plus the chosen response's NLL: its token mean over the response, per pair; "
        "TRL's is one token mean over the batch's prompt and response tokens).",
        "sigmoid",
        section="training",
        common=True,
    )
    beta: float = config_field(
        "Strength of the KL penalty towards the reference model: the implicit reward is beta x the log-ratio of "
        "policy to reference (TRL's default 0.1; lower lets the policy move further). ipo: the regulariser tau, "
        "the target per-token log-ratio margin is 1/(2 beta). simpo: the reward scale, beta x mean per-token "
        "log-prob (the SimPO paper uses 2-2.5). orpo: the weight lambda of the odds-ratio term (paper 0.1).",
        0.1,
        bounds="(0, inf)",
        section="training",
        common=True,
    )
    label_smoothing: float = config_field(
        "Assumed probability that a preference label is flipped, sigmoid and robust only (conservative DPO, cDPO, "
        "and robust DPO); 0 is plain DPO. sigmoid's is cDPO as in TRL <= 0.19: TRL 1.16's sigmoid ignores it.",
        0.0,
        bounds="[0, 0.5)",
        section="training",
    )
    simpo_gamma: float = config_field(
        "simpo only: the target reward margin gamma, loss -log sigmoid(beta x (chosen - rejected mean log-prob) - "
        "gamma) (TRL's default 0.5).",
        0.5,
        bounds="[0, inf)",
        section="training",
    )
    rpo_alpha: float | None = config_field(
        "Add rpo_alpha x the chosen response's NLL per token to the loss (RPO; the paper uses 1.0): each response's "
        "token mean, then the mean over pairs (TRL's is one token mean over the batch's chosen tokens). Any "
        "loss_type but orpo, whose NLL term is built in. null: none.",
        None,
        bounds="[0, inf)",
        section="training",
    )
    precompute_ref_log_probs: bool = config_field(
        "Compute the reference model's log-probabilities of every pair once before training and cache them with "
        "the data (no reference forward, or second model, during training).",
        False,
        section="training",
    )
    sft_warmup_steps: int | None = config_field(
        "Optimizer steps of plain SFT on the chosen responses before DPO, for a model that has not learnt the task "
        "format; unset: 150 for a fresh model built from a config (the embedded default), 0 for a loaded one.",
        None,
        bounds="[0, inf)",
        section="training",
    )

    # The embedded default run (see the class docstring).
    output_dir: str = new_default("outputs/dpo-default")
    max_seq_length: int = new_default(64, "Longest prompt + response in tokens.")
    learning_rate: float = new_default(2e-3)
    warmup_ratio: float = new_default(0.1)
    per_device_train_batch_size: int | Literal["auto"] = new_default(32, "Pairs per micro-batch per process.")
    per_device_eval_batch_size: int = new_default(64, "Pairs per evaluation batch per process.")
    max_steps: int = new_default(100)
    logging_steps: int = new_default(10)
    synthetic_train_size: int = new_default(4000, "Preference pairs of the synthetic task (when train_data is None).")
    synthetic_eval_size: int = new_default(200, "Held-out pairs of the synthetic task (when train_data is None).")

    def __post_init__(self) -> None:
        fill_cache_dir(self)
        fill_tiny_model(self)
        if self.sft_warmup_steps is None:  # a fresh model (built from a config) warms up; a loaded one not
            self.sft_warmup_steps = 150 if self.model_name_or_path is None else 0

    def validate(self) -> None:
        for check in (
            *TRAINING_CHECKS,
            *MODEL_DATA_CHECKS,
            check_label_smoothing,
            check_rpo_alpha,
            check_reference_to_precompute,
            check_sample_prompts,
            check_eval_harness,
            check_vision_keys,
        ):
            check(self)

    def check_files(self) -> None:
        check_data_files(self)
        check_image_dir(self)
        check_harness_tasks(self)
