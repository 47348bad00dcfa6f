"""The config of recipes/reward.py: a reward model trained on preference pairs (Bradley-Terry)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .checks import MODEL_DATA_CHECKS, TRAINING_CHECKS
from .fields import config_field, new_default
from .shared import ChatModelConfig

__all__ = ["RewardConfig"]


@dataclass
class RewardConfig(ChatModelConfig):
    """A reward model: `AutoModelForSequenceClassification` with one output, trained on (prompt, chosen, rejected)
    pairs with the Bradley-Terry loss (an optional `margin` column is subtracted from the reward difference).

    The defaults are the embedded offline run: the DPO default's digit-task pairs (the correct answer chosen, a
    plausible wrong one rejected), a locally trained tokenizer and a tiny Llama with a one-output head built from
    config; evaluation reports pairwise accuracy on held-out pairs.
    """

    # --- data
    overlong_examples: Literal["truncate", "drop"] = config_field(
        "Pairs longer than max_seq_length: cut the responses to fit (the prompt is kept whole) or drop the pair.",
        "truncate",
        section="data",
    )

    # The embedded default run (see the class docstring).
    output_dir: str = new_default("outputs/reward-default")
    max_seq_length: int = new_default(64, "Longest prompt + response in tokens.")
    learning_rate: float = new_default(1e-3)
    warmup_ratio: float = new_default(0.1)
    per_device_train_batch_size: int | Literal["auto"] = new_default(32, "Pairs per micro-batch per process.")
    per_device_eval_batch_size: int = new_default(64, "Pairs per evaluation batch per process.")
    max_steps: int = new_default(300)
    logging_steps: int = new_default(25)
    synthetic_train_size: int = new_default(8000, "Preference pairs of the synthetic task (when train_data is None).")
    synthetic_eval_size: int = new_default(200, "Held-out pairs of the synthetic task (when train_data is None).")

    def validate(self) -> None:
        for check in (*TRAINING_CHECKS, *MODEL_DATA_CHECKS):
            check(self)
