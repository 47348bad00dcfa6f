"""Generation evaluation's shared rules, and batched greedy generation against reference answers (exact match).

`stop_token_ids` is the one rule for what ends a generated answer, used by SFT's exact match and by GRPO's
rollouts and evaluation; `exact_match` (in `scores`) is the one comparison of an answer with its reference.
"""

from __future__ import annotations

import numpy as np
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from ..data.collate import PromptCollator
from ..models.attention import image_inputs
from ..models.build import eos_ids
from ..models.wrappers import unwrap
from .batches import gathered_batches
from .scores import exact_match

__all__ = ["generation_exact_match", "log_samples", "stop_token_ids"]


def stop_token_ids(model, tokenizer: PreTrainedTokenizerBase) -> int | list[int] | None:
    """What ends a generated answer: the tokenizer's EOS (the chat template's end of turn, see
    `setup_chat_template`) and every EOS id of the model's generation config (a chat model may have several; Llama
    3 Instruct has three), the tokenizer's first; one id as an int, several as a list, as `generate` takes them.

    `generate(eos_token_id=...)` replaces the generation config's ids rather than adding to them, so the union is
    passed explicitly. A model from `build_causal_lm` already holds the tokenizer's EOS first in its generation
    config, so for it this is that config's value.
    """
    return eos_ids(tokenizer.eos_token_id, getattr(model, "generation_config", None))


def log_samples(log, samples: list[dict[str, str]], step: int) -> None:
    """Log an evaluation's (prediction, reference) samples, labelled with when they were made: the untrained
    model's gibberish at step 0 says "before training", not passed off as what the run trained."""
    when = "before training" if step == 0 else f"step {step}"
    for s in samples:
        log.info("  %s: generated %r, reference %r", when, s["prediction"], s["reference"])


def _decode(tokenizer: PreTrainedTokenizerBase, ids: torch.Tensor) -> str:
    return tokenizer.decode([int(t) for t in ids if t >= 0], skip_special_tokens=True).strip()


@torch.no_grad()
def generation_exact_match(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    dataset,
    accelerator: Accelerator,
    *,
    batch_size: int,
    max_new_tokens: int,
    max_samples: int | None = None,
    disable_tqdm: bool = True,
    collate_fn=None,
) -> tuple[dict[str, float], list[dict[str, str]]]:
    """Exact match of greedy generations against the last assistant turn of each example.

    Both sides are decoded without special tokens and stripped of surrounding whitespace. Returns the metrics
    and a few (prediction, reference) samples from the main process for the log. `collate_fn` replaces
    `PromptCollator` (a vision-language model's `VisionPromptCollator`, which adds each prompt's images); the image
    inputs it gives go to `generate` with the prompts.
    """
    # Plain-text examples (prompt_length 0) have no prompt to answer: they count in the eval loss only.
    with_prompt = np.flatnonzero(np.asarray(dataset.data.column("prompt_length")) > 0)
    if len(with_prompt) == 0:
        return {}, []
    dataset = dataset.select(with_prompt[:max_samples] if max_samples else with_prompt)
    images = [c for c in ("images", "where") if collate_fn is not None and c in dataset.column_names]
    dataset = dataset.select_columns(["input_ids", "labels", "prompt_length", *images])
    collate_fn = collate_fn or PromptCollator(tokenizer.pad_token_id)
    loader = accelerator.prepare_data_loader(DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn))
    unwrapped = unwrap(model)
    stop = stop_token_ids(unwrapped, tokenizer)

    def answers(batch) -> list[tuple[str, str]]:
        out = unwrapped.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=stop,
            **image_inputs(batch),
        )
        generated = out[:, batch["input_ids"].shape[1] :]
        return [(_decode(tokenizer, g), _decode(tokenizer, r)) for g, r in zip(generated, batch["reference_ids"])]

    pairs, samples = [], []
    for gathered in gathered_batches(unwrapped, loader, accelerator, answers, objects=True, desc="Generating",
                                     disable_tqdm=disable_tqdm):  # fmt: skip
        pairs += gathered
        samples.extend({"prediction": p, "reference": r} for p, r in gathered[: max(0, 5 - len(samples))])
    return {"eval_exact_match": exact_match([p for p, _ in pairs], [r for _, r in pairs])}, samples
