"""The config of recipes/sft.py: supervised fine-tuning of a causal LM on instruction or chat data."""

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
    check_split_turns,
    check_streamed_group_by_length,
)
from .fields import config_field, new_default
from .shared import CausalLMConfig, ChatModelConfig
from .vision import VisionConfig, check_image_dir, check_vision_keys

__all__ = ["SFTConfig"]


@dataclass
class SFTConfig(CausalLMConfig, VisionConfig, ChatModelConfig):
    """Supervised fine-tuning of a causal LM on instruction or chat data.

    The defaults are the embedded offline run: a synthetic digit task, a locally trained tokenizer and a tiny
    Llama built from config. Hyperparameters such as `learning_rate` are tuned for that tiny model; configs for
    real models set their own (see recipes/configs/sft/). A vision-language model (`AutoModelForImageTextToText`)
    trains on conversations with images (the `VisionConfig` keys; recipes/configs/sft/vlm_default.yaml).
    """

    # --- data
    data_format: Literal["auto", "chat", "sharegpt", "alpaca", "prompt_completion", "text"] = config_field(
        "Data format; auto detects it from the columns (in this order): chat (messages), sharegpt (conversations), "
        "alpaca (instruction, output), prompt_completion (prompt, completion: strings or message lists), text "
        "(dataset_text_field; every token carries the loss).",
        "auto",
        section="data",
        common=True,
    )
    dataset_text_field: str = config_field(
        "The plain-text column of text data (data_format text).", "text", section="data"
    )
    overlong_examples: Literal["truncate", "drop"] = config_field(
        "Truncate or drop examples longer than max_seq_length.", "truncate", section="data"
    )
    assistant_only_loss: bool = config_field(
        "Compute the loss on assistant turns only; in a prompt/completion row, on its completion's only (the prompt "
        "is context, its assistant turns too: TRL's completion_only_loss).",
        True,
        section="data",
    )
    split_turns: bool = config_field(
        "One example per assistant turn: the conversation up to it, rendered as the chat template renders it when "
        "that turn is the last (as at generation). For templates that render earlier turns differently once later "
        "ones follow (Qwen3, GPT-OSS), which stop otherwise; costs about k times the tokens for k turns.",
        False,
        section="data",
    )
    packing: bool = config_field(
        "Pack examples into rows of max_seq_length (best-fit decreasing) with attention kept inside each example; "
        "removes nearly all padding.",
        False,
        section="data",
        common=True,
    )
    packing_buffer_size: int = config_field(
        "With streaming: true: examples read, tokenised and (with packing) packed best-fit together at a time. "
        "Larger packs fuller rows; a resumed run reads the current buffer again.",
        1000,
        bounds="[1, inf)",
        section="data",
    )
    group_by_length: bool = config_field(
        "Without packing: batch examples of similar length together, so a batch pads only to similar lengths. "
        "Off by default (as in TrainingArguments): it makes batches less random, and where length correlates "
        "with content it hurts; on the synthetic task it groups by task and the model stops learning.",
        False,
        section="data",
    )
    # --- evaluation
    generation_eval: bool = config_field(
        "Score greedy generations against the reference answers (exact match).", True, section="evaluation"
    )
    generation_max_new_tokens: int = config_field(
        "Tokens to generate per eval prompt.", 32, bounds="[1, inf)", section="evaluation"
    )
    generation_eval_max_samples: int = config_field(
        "Generate answers for at most this many eval examples (0: all): generation is slow, and an eval split of "
        "thousands would take longer than training.",
        64,
        bounds="[0, inf)",
        section="evaluation",
    )

    # The embedded default run (see the class docstring).
    output_dir: str = new_default("outputs/sft-default")
    learning_rate: float = new_default(3e-3)
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = new_default("cosine")
    warmup_ratio: float = new_default(0.05)
    per_device_train_batch_size: int | Literal["auto"] = new_default(32)
    per_device_eval_batch_size: int = new_default(100)
    num_train_epochs: float = new_default(2.0)
    logging_steps: int = new_default(25)

    streams: ClassVar[bool] = True

    def validate(self) -> None:
        for check in (*TRAINING_CHECKS, *MODEL_DATA_CHECKS, check_streamed_group_by_length, check_split_turns,
                      check_sample_prompts, check_eval_harness, check_vision_keys):  # fmt: skip
            check(self)

    def check_files(self) -> None:
        check_data_files(self)
        check_image_dir(self)
        check_harness_tasks(self)
