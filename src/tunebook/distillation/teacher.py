"""The teacher: loaded (sharing the student's tokenizer, checked) or built from a config and taught the task first,
then frozen in the dtype it runs in, and under DeepSpeed ZeRO-3 partitioned as DPO's reference is."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ..errors import ConfigError, ModelError
from ..models.build import build_causal_lm, is_partitioned, model_options, whole_weights
from ..models.tokenizer import load_tokenizer
from ..training.warmup import sft_warmup

__all__ = ["build_teacher", "check_shared_tokenizer", "teacher_dtype"]


def check_shared_tokenizer(config, tokenizer) -> None:
    """The teacher's own tokenizer maps every token to the id the student's does (the student's may have more: the
    tokens a chat template set-up adds, for which both models' embeddings grow alike). Distillation compares the two
    models' distributions over token ids, so any other tokenizer makes it compare unrelated tokens."""
    name = config.teacher_model_name_or_path
    try:
        theirs = load_tokenizer(name, config.trust_remote_code)
    except ModelError as e:
        raise ConfigError(
            f"teacher_model_name_or_path {name}: no tokenizer to check against the student's: {e}"
        ) from None
    ours = tokenizer.get_vocab()
    for token, index in sorted(theirs.get_vocab().items(), key=lambda item: item[1]):
        if ours.get(token) != index:
            raise ConfigError(f"teacher_model_name_or_path {name}: its tokenizer differs from the student's (token "
                              f"{token!r} is id {index} there, {ours.get(token)} here); distillation needs the teacher "
                              "to share the student's tokenizer")  # fmt: skip


def teacher_dtype(config, device: torch.device, student_dtype: torch.dtype) -> torch.dtype:
    """auto: bfloat16 on a GPU that computes in it, else the student's dtype (CPUs run bf16 matmuls slower)."""
    if config.teacher_dtype != "auto":
        return getattr(torch, config.teacher_dtype)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return student_dtype


def build_teacher(config, data, device, student_dtype: torch.dtype, log: logging.Logger) -> torch.nn.Module:
    """The frozen teacher on `device`: loaded from `teacher_model_name_or_path` or built from `teacher_model_config`,
    with `teacher_warmup_steps` of SFT on the training data first (in float32, before it is cast to the dtype it runs
    in). Call before `accelerator.prepare`; under ZeRO-3 hand it to `partition_reference` afterwards."""
    tokenizer = data.tokenizer
    if config.teacher_model_name_or_path is not None:
        check_shared_tokenizer(config, tokenizer)
    options = replace(model_options(config), model_name_or_path=config.teacher_model_name_or_path,
                      model_config=config.teacher_model_config, frozen_base=False, load_in_4bit=False,
                      gradient_checkpointing=False, use_liger_kernel=False)  # fmt: skip
    teacher = build_causal_lm(tokenizer, options)
    with whole_weights(teacher):  # under ZeRO-3 built partitioned: whole while it trains
        if config.teacher_warmup_steps:
            log.info("Teaching the teacher the task: %d steps of SFT", config.teacher_warmup_steps)
            sft_warmup(teacher, data.train.select_columns(["input_ids", "labels"]), tokenizer.pad_token_id,
                       steps=config.teacher_warmup_steps, batch_size=config.per_device_train_batch_size,
                       seed=config.seed, device=device, log=log, learning_rate=config.teacher_warmup_learning_rate,
                       lr_scheduler_type="cosine", max_grad_norm=1.0,
                       pad_to_multiple_of=config.pad_to_multiple_of)  # fmt: skip
    teacher = teacher.requires_grad_(False).eval().to(device)
    dtype = teacher_dtype(config, device, student_dtype)
    if not is_partitioned(teacher):  # under ZeRO-3 its engine's precision decides (partition_reference)
        teacher = teacher.to(dtype)
    log.info("Teacher: %s, %s parameters, %s, frozen", type(teacher).__name__,
             f"{sum(p.numel() for p in teacher.parameters()):,}", dtype)  # fmt: skip
    return teacher
