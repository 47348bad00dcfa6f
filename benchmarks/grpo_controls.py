"""The control reward of benchmarks/grpo_default.py, in a file of its own: a GRPO run imports reward files by path,
outside the benchmarks folder's imports."""

from __future__ import annotations

import random

_shuffle = random.Random(0)


def shuffled_exact_match(prompts, completions, answer, **_) -> list[float]:
    """Exact match against `answer`, shuffled among the batch's completions: the rewards keep their mean and spread
    and say nothing about the completion they are paired with."""
    rewards = [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]
    _shuffle.shuffle(rewards)
    return rewards
