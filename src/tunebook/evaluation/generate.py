"""Batched greedy generation against reference answers (exact match), split across processes."""

from __future__ import annotations

import numpy as np
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from ..data.collate import PromptCollator
from ..models.wrappers import unwrap
from ..run.logging import progress_bar
from .metrics import load_metric

__all__ = ["generation_exact_match"]


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
) -> tuple[dict[str, float], list[dict[str, str]]]:
    """Exact match of greedy generations against the last assistant turn of each example.

    Both sides are decoded without special tokens and stripped of surrounding whitespace. Returns the metrics
    and a few (prediction, reference) samples from the main process for the log.
    """
    # Plain-text examples (prompt_length 0) have no prompt to answer: they count in the eval loss only.
    with_prompt = np.flatnonzero(np.asarray(dataset.data.column("prompt_length")) > 0)
    if len(with_prompt) == 0:
        return {}, []
    dataset = dataset.select(with_prompt[:max_samples] if max_samples else with_prompt)
    dataset = dataset.select_columns(["input_ids", "labels", "prompt_length"])
    loader = accelerator.prepare_data_loader(
        DataLoader(dataset, batch_size=batch_size, collate_fn=PromptCollator(tokenizer.pad_token_id))
    )
    unwrapped = unwrap(model)
    was_training = unwrapped.training
    unwrapped.eval()
    exact_match, samples = load_metric("exact_match"), []
    for batch in progress_bar(
        accelerator.is_main_process, disable_tqdm, iterable=loader, desc="Generating", leave=False
    ):
        out = unwrapped.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        generated = out[:, batch["input_ids"].shape[1] :]
        pairs = [(_decode(tokenizer, g), _decode(tokenizer, r)) for g, r in zip(generated, batch["reference_ids"])]
        # Strings from every process; the duplicates that even out the last batch are dropped.
        pairs = accelerator.gather_for_metrics(pairs, use_gather_object=True)
        exact_match.add_batch(predictions=[p for p, _ in pairs], references=[r for _, r in pairs])
        samples.extend({"prediction": p, "reference": r} for p, r in pairs[: max(0, 5 - len(samples))])
    unwrapped.train(was_training)
    return {"eval_exact_match": exact_match.compute()["exact_match"]}, samples
