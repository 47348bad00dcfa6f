"""The GSM8K reward of recipes/configs/grpo/qwen25_1p5b_gsm8k.yaml: exact match of the final number.

GSM8K's `answer` column is a worked solution that ends with `#### 72`; a model's completion is its own worked
solution. The built-in `exact_match` compares whole texts, so it would score almost every right answer 0. This one
compares the numbers only: the reference's after `####`, the completion's in its last `\\boxed{...}` (what Qwen2.5
instruct models write for maths), else after its last `####`, else its last number. Thousands separators and a
trailing `.0` do not count as a difference ("1,000" and "1000.0" equal 1000).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def gsm8k_exact_match(prompts, completions, answer, **columns) -> list[float]:
    """1.0 where a completion's final number equals the reference's (`answer`'s after `####`), else 0.0."""
    return [float(_final_number(c) is not None and _final_number(c) == _reference(a)) for c, a in
            zip(completions, answer, strict=True)]  # fmt: skip


def _reference(solution: str) -> Decimal | None:
    return _number(str(solution).rpartition("####")[2])


def _final_number(completion: str) -> Decimal | None:
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", completion)
    if boxed:
        return _number(boxed[-1])
    if "####" in completion:
        return _number(completion.rpartition("####")[2])
    numbers = _NUMBER.findall(completion)
    return _number(numbers[-1]) if numbers else None


def _number(text: str) -> Decimal | None:
    """The first number in `text`, without thousands separators; None when there is none."""
    match = _NUMBER.search(text.replace("$", ""))
    if match is None:
        return None
    try:
        return Decimal(match.group().replace(",", "")).normalize()
    except InvalidOperation:
        return None
