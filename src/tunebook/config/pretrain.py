"""The config of recipes/pretrain.py: continued pretraining of a causal LM on plain text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from .checks import (
    MODEL_DATA_CHECKS,
    TRAINING_CHECKS,
    check_data_files,
    check_eval_harness,
    check_harness_tasks,
    check_sample_prompts,
)
from .fields import config_field, new_default
from .shared import CausalLMConfig, ModelDataConfig

__all__ = ["PretrainConfig"]


@dataclass
class PretrainConfig(CausalLMConfig, ModelDataConfig):
    """Continued pretraining of a causal LM on plain text (next-token loss on every token).

    The defaults are the embedded offline run: generated topical documents, a locally trained tokenizer and a
    tiny Llama built from config (tunebook.models.TINY_LLAMA); evaluation reports loss and perplexity.
    """

    streams: ClassVar[bool] = True

    # --- data
    text_column: str = config_field(
        "Column holding the documents (a .txt file gives a 'text' column).", "text", section="data", common=True
    )
    text_sample_by: Literal["document", "paragraph", "line"] = config_field(
        "What one document is in a .txt file: the whole file, each blank-line separated paragraph, or each line.",
        "paragraph",
        section="data",
    )

    # The embedded default run (see the class docstring).
    output_dir: str = new_default("outputs/pretrain-default")
    max_seq_length: int = new_default(
        256, "Tokens per training row (documents are cut to fit and never attend across)."
    )
    learning_rate: float = new_default(3e-3)
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = new_default("cosine")
    warmup_ratio: float = new_default(0.05)
    per_device_train_batch_size: int | Literal["auto"] = new_default(16)
    per_device_eval_batch_size: int = new_default(16)
    num_train_epochs: float = new_default(2.0)
    synthetic_train_size: int = new_default(2000, "Documents of the synthetic corpus (when train_data is None).")
    synthetic_eval_size: int = new_default(
        100, "Held-out documents of the synthetic corpus (when train_data is None)."
    )
    # A pretrained model reads plain text: its harness prompts too, whatever chat template its tokenizer carries.
    eval_harness_chat_template: bool | None = new_default(
        False,
        "Render the harness prompts with the tokenizer's chat template (false: plain text, as pretraining reads).",
    )

    def validate(self) -> None:
        for check in (*TRAINING_CHECKS, *MODEL_DATA_CHECKS, check_sample_prompts, check_eval_harness):
            check(self)

    def check_files(self) -> None:
        check_data_files(self)
        check_harness_tasks(self)
