"""Reward functions for GRPO: plain Python functions `(prompts, completions, **columns) -> list[float]`.

`prompts` are the data set's `prompt` values (text, or lists of messages), `completions` the decoded completions
(text), and `columns` every other column of the prompts' rows, plus `completion_lengths` (tokens). A function may
return None for a completion it does not apply to (it then adds nothing to that completion's reward).

With a vision-language model's prompts (`tunebook.rl.vision_prompts`), `images` is each completion's list of its
prompt's image paths, resolved (absolute, or the URL as given; None for an image the data holds as bytes), in the
order of the prompt's image placeholders; it takes the place of the data's own `images`/`image` column:

    def colour_named(prompts, completions, images, answer, **columns):  # images[i]: ["/data/shapes/3f2a.png"]
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

Built in, by name: `exact_match` (the completion, stripped, equals the `reference_column` value, stripped),
`format_regex` (the whole stripped completion matches `format_pattern`), `length_penalty` (0 up to
`max_new_tokens - length_penalty_buffer` tokens, then down linearly to -1 at `max_new_tokens`: DAPO's soft
overlong punishment). A user's own: `path/to/file.py:function`. A trained reward model: `reward_model: DIR`.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError, TunebookError
from ..evaluation.scores import exact_matches
from ..user_code import load_function, user_failure

__all__ = [
    "RewardFunction",
    "combined",
    "describe",
    "exact_match",
    "format_regex",
    "length_penalty",
    "load_reward_functions",
    "score",
]

logger = logging.getLogger("tunebook")


@dataclass(frozen=True)
class RewardFunction:
    name: str  # logged as rewards/<name>: the built-in's name, or the function's, from a file
    fn: Callable[..., Sequence[float | None]]
    weight: float
    spec: str = ""  # as the config gives it: a built-in's name, path/to/file.py:function, or reward_model


def exact_match(prompts, completions, *, reference: Sequence, **_) -> list[float]:
    return exact_matches(completions, [str(r) for r in reference])  # the rule of eval_exact_match


def format_regex(prompts, completions, *, pattern: str, **_) -> list[float]:
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]


def length_penalty(prompts, completions, *, completion_lengths: Sequence[int], max_new_tokens: int, buffer: int,
                   **_) -> list[float]:  # fmt: skip
    start = max_new_tokens - buffer
    return [-min(max(n - start, 0) / max(buffer, 1), 1.0) for n in completion_lengths]


def load_reward_functions(config, device=None) -> list[RewardFunction]:
    """The config's `reward_functions` (and `reward_model`), each with its weight from `reward_weights`."""
    specs = list(config.reward_functions)
    if config.reward_model:
        specs.append("reward_model")
    weights = list(config.reward_weights) if config.reward_weights else [1.0] * len(specs)
    if len(weights) != len(specs):
        raise ConfigError(f"reward_weights has {len(weights)} values for {len(specs)} reward functions "
                          f"({', '.join(specs)}); give one weight each")  # fmt: skip
    functions, names = [], []
    for spec, weight in zip(specs, weights):
        name = spec.rpartition(":")[2] if ":" in spec else spec
        name = name if name not in names else f"{name}_{len(names)}"  # two files' functions of the same name
        names.append(name)
        functions.append(RewardFunction(name, _reward_function(spec, config, device), float(weight), spec))
    if config.reward_model and config.reward_functions and config.scale_rewards == "group":
        # Measured in notebooks/04_sft_reward_grpo: exact match 0.56 -> 0.29 under group, 0.56 -> 0.70 under batch.
        logger.warning("reward_model next to reward functions, advantages scaled by group: where a group's other "
                       "rewards are all equal (every answer wrong), its own small spread makes the reward model's "
                       "noise a full-size advantage; scale_rewards: batch keeps it at its weight")  # fmt: skip
    return functions


def _reward_function(spec: str, config, device) -> Callable:
    if spec == "exact_match":
        column = config.reference_column

        def fn(prompts, completions, **columns):
            if column not in columns:
                raise ConfigError(f"reward exact_match needs the reference column {column!r} in the prompt data "
                                  f"(found {sorted(columns)}); set reference_column")  # fmt: skip
            return exact_match(prompts, completions, reference=columns[column])

        return fn
    if spec == "format_regex":
        if not config.format_pattern:
            raise ConfigError("reward format_regex needs format_pattern (a regular expression the whole completion "
                              "must match)")  # fmt: skip
        return lambda prompts, completions, **columns: format_regex(
            prompts, completions, pattern=config.format_pattern
        )
    if spec == "length_penalty":
        return lambda prompts, completions, completion_lengths, **columns: length_penalty(
            prompts, completions, completion_lengths=completion_lengths, max_new_tokens=config.max_new_tokens,
            buffer=config.length_penalty_buffer,
        )  # fmt: skip
    if spec == "reward_model":
        from ..preference.reward import load_reward_model

        return load_reward_model(config.reward_model, device=device, use_safetensors=config.use_safetensors,
                                 trust_remote_code=config.trust_remote_code)  # fmt: skip
    # GRPOConfig.validate let through only built-in names and file:function specs, and loaded each file once.
    return load_function(spec, "reward function")


def score(functions: list[RewardFunction], prompts: list, completions: list[str], columns: dict[str, list],
          device, when: str = "") -> torch.Tensor:  # fmt: skip
    """Rewards of each completion under each function, shape (completions, functions), float32; NaN where a
    function returned None. A function that raises or exits (`sys.exit`), returns the wrong number of values or a
    non-number stops the run with one line naming it; `when` ("at step 3") says when in that line."""
    out = torch.full((len(completions), len(functions)), math.nan, dtype=torch.float32)
    for j, f in enumerate(functions):
        named = f"reward function {f.spec or f.name!r}{' ' + when if when else ''}"
        try:
            values = f.fn(prompts, completions, **columns)
        except (TunebookError, KeyboardInterrupt, GeneratorExit):  # ours name the function; Ctrl-C stops the run
            raise
        except BaseException as error:  # SystemExit too (see user_failure): the user's code, in one line
            raise ConfigError(f"{named} raised {user_failure(error)}") from None
        values = list(values) if values is not None else None
        if values is None or len(values) != len(completions):
            got = "None" if values is None else f"{len(values)} values"
            raise ConfigError(f"{named} returned {got} for {len(completions)} completions; it must return one "
                              "float (or None) per completion")  # fmt: skip
        for i, v in enumerate(values):
            if v is None:
                continue
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if not isinstance(v, numbers.Real) or not math.isfinite(float(v)):  # numpy scalars and bools are Real
                raise ConfigError(f"{named} returned {v!r} for completion {i}; rewards must be finite numbers (or "
                                  "None)")  # fmt: skip
            out[i, j] = float(v)
    return out.to(device)


def combined(rewards: torch.Tensor, functions: list[RewardFunction]) -> torch.Tensor:
    """Each completion's reward: the weighted sum over functions, a None (NaN) counting as 0."""
    weights = torch.tensor([f.weight for f in functions], dtype=rewards.dtype, device=rewards.device)
    return torch.nan_to_num(rewards, nan=0.0) @ weights


def describe(functions: list[RewardFunction], config=None) -> str:
    """The reward functions with their weights; with a GRPO `config`, what the advantages are made of too."""
    text = ", ".join(f"{f.name} x {f.weight:g}" for f in functions)
    if config is None:
        return text
    return (f"{text}; {config.num_generations} completions per prompt, loss {config.loss_type}, advantages scaled by "
            f"{config.scale_rewards}")  # fmt: skip
