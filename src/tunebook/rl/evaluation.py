"""Greedy completions of held-out prompts, scored by the run's reward functions, split across processes."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from ..evaluation.batches import gathered_batches
from ..evaluation.generate import stop_token_ids
from ..evaluation.scores import exact_matches
from ..models.wrappers import unwrap
from .episodes import GreedyBackend
from .grpo import sample_completions
from .prompts import PromptRows, reward_inputs
from .rewards import RewardFunction, combined, score
from .vision_prompts import prompt_images

__all__ = ["evaluate_completions"]


@torch.no_grad()
def evaluate_completions(model, tokenizer, dataset, functions: list[RewardFunction], accelerator, *, batch_size: int,
                         max_new_tokens: int, reference_column: str, disable_tqdm: bool = True,
                         when: str = "in evaluation", collate_fn=None, processor=None, episodes=None):  # fmt: skip
    """(metrics, samples): the mean reward of greedy completions (`eval_reward`, and per function
    `eval_rewards/<name>`), their exact match against `reference_column` when the data has it (`eval_exact_match`,
    whether or not it is a reward), and their mean length in tokens. Exact over processes: every prompt counts
    once (the duplicates that even out the last batch are dropped). `when` goes into a failing reward's error. A
    vision-language model's prompts come with their images: `collate_fn` a `VisionPromptRows`, and its `processor`.
    With `episodes` (a `tunebook.rl.episodes.EpisodeRunner`, tools) each prompt is a greedy multi-turn episode,
    scored on its final answer; `eval_tools/call_rate` is the fraction of episodes that called a tool."""
    collate_fn = collate_fn or PromptRows()
    loader = accelerator.prepare_data_loader(DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn))
    unwrapped = unwrap(model)
    stop = stop_token_ids(unwrapped, tokenizer)

    def scored(batch) -> list[tuple]:
        seeds, ran = [0] * len(batch["prompt_ids"]), None
        if episodes is not None:  # multi-turn episodes with tools, each turn greedy
            ran = episodes.run(GreedyBackend(unwrapped, accelerator.device), batch, 1, seeds)
            completions, texts = ran.token_ids, ran.texts
        else:
            completions = sample_completions(
                unwrapped, batch["prompt_ids"], seeds, pad_token_id=tokenizer.pad_token_id, eos_token_id=stop,
                max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0, device=accelerator.device, greedy=True,
                images=prompt_images(batch, processor),
            )  # fmt: skip
            texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        prompts, columns = reward_inputs(batch, completions, 1, ran)
        per_function = score(functions, prompts, texts, columns, "cpu", when)
        total = combined(per_function, functions)
        references = [str(r) for r in columns[reference_column]] if reference_column in columns else None
        matches = exact_matches(texts, references) if references else [float("nan")] * len(texts)
        calls = ran.tool_calls if ran else [0] * len(texts)
        return [(float(total[i]), per_function[i].tolist(), matches[i], columns["completion_lengths"][i], texts[i],
                 references[i] if references else None, calls[i] > 0) for i in range(len(texts))]  # fmt: skip

    results, samples = [], []
    for rows in gathered_batches(unwrapped, loader, accelerator, scored, objects=True, desc="Generating",
                                 disable_tqdm=disable_tqdm):  # fmt: skip
        results += rows
        samples += [{"prediction": r[4], "reference": r[5]} for r in rows[: max(0, 3 - len(samples))]]
    n = max(len(results), 1)
    metrics = {"eval_reward": sum(r[0] for r in results) / n}
    for j, f in enumerate(functions):
        values = [r[1][j] for r in results if r[1][j] == r[1][j]]  # NaN: the function gave None
        metrics[f"eval_rewards/{f.name}"] = sum(values) / len(values) if values else None
    if results and results[0][2] == results[0][2]:
        metrics["eval_exact_match"] = sum(r[2] for r in results) / n
    metrics["eval_completion_length"] = sum(r[3] for r in results) / n
    if episodes is not None:
        metrics["eval_tools/call_rate"] = sum(r[6] for r in results) / n
    return metrics, samples
