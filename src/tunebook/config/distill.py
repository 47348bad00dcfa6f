"""The config of recipes/distill.py: knowledge distillation of a student causal LM from a teacher (GKD)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ..errors import ConfigError
from .checks import (
    MODEL_DATA_CHECKS,
    TRAINING_CHECKS,
    check_data_files,
    check_eval_harness,
    check_harness_tasks,
    check_sample_prompts,
    check_split_turns,
)
from .fields import config_field, new_default
from .sft import SFTConfig
from .shared import fill_cache_dir, fill_tiny_model
from .tiny import TINY_LLAMA, TINY_STUDENT

__all__ = ["DistillConfig"]


@dataclass
class DistillConfig(SFTConfig):
    """Knowledge distillation of a causal LM (the student) from a teacher that shares its tokenizer: the generalized
    Jensen-Shannon divergence of TRL's GKD between their next-token distributions on the completions, which come
    from the data, from the student (`lmbda`: on-policy) or from the teacher (`seq_kd`). The data keys and formats
    are SFT's (prompt/completion, messages, alpaca, ...); the loss is on what SFT's would be on.

    The defaults are the embedded offline run: the SFT default's digit task and tokenizer, a teacher of the tiny
    Llama's size trained on it in-process first (`teacher_warmup_steps`), and a student of half its depth, distilled
    from it.
    """

    # --- the teacher
    teacher_model_name_or_path: str | None = config_field(
        "The teacher: a local directory or a Hub name. It must use the student's tokenizer (the same vocabulary, "
        "token for token). Unset: a fresh teacher built from teacher_model_config.",
        None,
        section="model",
        common=True,
    )
    teacher_model_config: dict | str | None = config_field(
        "Build a fresh teacher from this config (a dict or a config.json/YAML path; vocabulary from the tokenizer) "
        "when teacher_model_name_or_path is unset; unset: the tiny Llama (the embedded default), trained on the data "
        "for teacher_warmup_steps first.",
        None,
        section="model",
    )
    teacher_dtype: Literal["auto", "float32", "bfloat16", "float16"] = config_field(
        "The teacher's weights while it runs (it has no gradients or optimizer). auto: bfloat16 on a GPU that "
        "supports it, else the student's dtype (CPUs run bfloat16 matmuls slower than float32).",
        "auto",
        section="model",
    )
    teacher_warmup_steps: int | None = config_field(
        "Optimizer steps of plain SFT of the teacher on the training data before distillation (a teacher that "
        "knows nothing teaches nothing); unset: 500 for a fresh teacher built from a config (the embedded default), "
        "0 for a loaded one.",
        None,
        bounds="[0, inf)",
        section="training",
    )
    teacher_warmup_learning_rate: float = config_field(
        "The teacher's warm-up learning rate (cosine schedule, 5% warm-up, gradients clipped at 1).",
        3e-3,
        bounds="(0, inf)",
        section="training",
    )
    # --- distillation (TRL GKDConfig's names)
    beta: float = config_field(
        "The divergence, TRL's generalized JSD: 0 forward KL(teacher || student) (mass-covering), 1 reverse "
        "KL(student || teacher) (mode-seeking), in between beta KL(teacher || M) + (1-beta) KL(student || M) with the "
        "mixture M = (1-beta) student + beta teacher. TRL's default is 0.5; 0 here: a fresh student far from its "
        "teacher gets the cross-entropy's gradient from forward KL, and on the digit task JSD 0.5 had taught it "
        "nothing after 200 steps.",
        0.0,
        bounds="[0, 1]",
        section="training",
        common=True,
    )
    lmbda: float = config_field(
        "The share of optimizer steps whose completions the student samples from the batch's prompts (on-policy; "
        "GKD's lambda, TRL's lmbda, default 0.5); the others train on the data's (or, with seq_kd, the teacher's).",
        0.5,
        bounds="[0, 1]",
        section="training",
        common=True,
    )
    temperature: float = config_field(
        "Both distributions are softmax(logits / temperature) in the divergence, and sampled completions are "
        "drawn at it (TRL's default 0.9).",
        0.9,
        bounds="(0, inf)",
        section="training",
    )
    seq_kd: bool = config_field(
        "Sequence-level KD: the teacher samples the completions of every step that is not on-policy (TRL's seq_kd).",
        False,
        section="training",
    )
    alpha: float = config_field(
        "Mix in the plain cross-entropy of the completion tokens trained on: loss = (1 - alpha) x divergence + "
        "alpha x cross-entropy, per token (not in TRL's GKD; 0: distillation only).",
        0.0,
        bounds="[0, 1]",
        section="training",
    )
    max_new_tokens: int = config_field(
        "Longest completion the student (lmbda) or teacher (seq_kd) samples, in tokens (TRL's default 128; the "
        "digit task's answers are under 10).",
        16,
        bounds="[1, inf)",
        section="training",
    )

    # The embedded default run (see the class docstring).
    output_dir: str = new_default("outputs/distill-default")
    learning_rate: float = new_default(3e-3)
    num_train_epochs: float = new_default(1.0)
    max_steps: int = new_default(600)
    synthetic_train_size: int = new_default(6000)
    per_device_eval_batch_size: int = new_default(64)
    generation_max_new_tokens: int = new_default(12)
    logging_steps: int = new_default(25)

    tiny_model: ClassVar[dict] = TINY_STUDENT  # the student; the teacher's is TINY_LLAMA
    streams: ClassVar[bool] = False

    def __post_init__(self) -> None:
        fill_cache_dir(self)
        fill_tiny_model(self)  # the student's (`tiny_model`) when no model is named
        fresh_teacher = self.teacher_model_name_or_path is None
        if fresh_teacher and self.teacher_model_config is None:
            self.teacher_model_config = dict(TINY_LLAMA)
        if self.teacher_warmup_steps is None:  # a fresh teacher learns the task first; a loaded one is the teacher
            self.teacher_warmup_steps = 500 if fresh_teacher else 0

    def validate(self) -> None:
        for check in (*TRAINING_CHECKS, *MODEL_DATA_CHECKS, check_split_turns, check_sample_prompts,
                      check_eval_harness, check_distill_data, check_teacher):  # fmt: skip
            check(self)

    def check_files(self) -> None:
        check_data_files(self)
        check_harness_tasks(self)


def check_distill_data(config: Any) -> None:
    """Padded prompt/completion rows only: the student and teacher read the same rows, and sampled completions
    replace the data's after each prompt."""
    if config.packing:
        raise ConfigError("packing: true is not supported by distill (sampled completions replace each example's "
                          "own after its prompt); set packing: false")  # fmt: skip
    if config.image_dir is not None:
        raise ConfigError(f"image_dir: {config.image_dir}: distill trains text models only")


def check_teacher(config: Any) -> None:
    if config.teacher_model_name_or_path is not None and config.teacher_model_config is not None:
        raise ConfigError("teacher_model_name_or_path and teacher_model_config are both set: the teacher is loaded "
                          "from one or built from the other; unset one")  # fmt: skip
