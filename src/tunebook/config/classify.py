"""The config of recipes/classify.py: text or text-pair classification."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from .checks import MODEL_DATA_CHECKS, TRAINING_CHECKS, check_label_names
from .fields import config_field, new_default
from .shared import ModelDataConfig
from .tiny import TINY_BERT

__all__ = ["ClassifyConfig"]


@dataclass
class ClassifyConfig(ModelDataConfig):
    """Text or text-pair classification with `AutoModelForSequenceClassification`.

    The defaults are the embedded offline run: a generated 4-topic task, a locally trained WordPiece tokenizer and
    a tiny BERT built from config (tunebook.models.TINY_BERT).
    """

    tiny_model: ClassVar[dict] = TINY_BERT

    # --- data
    text_column: str = config_field("Column with the text to classify.", "text", section="data", common=True)
    text_pair_column: str | None = config_field(
        "Column with the second text of a pair (None: single texts).", None, section="data"
    )
    label_column: str = config_field(
        "Column with the labels: class names (strings) or class ids (integers).", "label", section="data", common=True
    )
    label_names: list[str] | None = config_field(
        "The classes in id order (None: the sorted distinct string labels of train_data, or 0..K-1 for integers).",
        None,
        section="data",
    )
    # --- evaluation
    metrics: list[str] = config_field(
        "evaluate metrics computed on the eval set (Tunebook ships accuracy, f1, precision, recall offline).",
        default_factory=lambda: ["accuracy", "f1", "precision", "recall"],
        section="evaluation",
    )
    metric_average: Literal["binary", "macro", "micro", "weighted"] | None = config_field(
        "Averaging of f1/precision/recall (None: binary for 2 classes, else macro).", None, section="evaluation"
    )

    # The embedded default run (see the class docstring).
    output_dir: str = new_default("outputs/classify-default")
    max_seq_length: int = new_default(128, "Longest tokenised example in tokens (longer ones are truncated).")
    learning_rate: float = new_default(2e-3)
    warmup_ratio: float = new_default(0.05)
    per_device_train_batch_size: int | Literal["auto"] = new_default(32)
    per_device_eval_batch_size: int = new_default(64)
    num_train_epochs: float = new_default(2.0)
    synthetic_train_size: int = new_default(4000)
    synthetic_eval_size: int = new_default(400)

    def validate(self) -> None:
        for check in (*TRAINING_CHECKS, *MODEL_DATA_CHECKS, check_label_names):
            check(self)
