"""Multi-turn episodes: the model's turns, generated through a backend, and the environment's answers between them.

An episode's trained sequence is its prompt (the opening messages and the tools' definitions, rendered with the chat
template's generation prompt) followed by [model turn, environment tokens, model turn, ...]. The model's turns are
kept as the tokens it generated, never decoded and re-tokenised; the environment's messages are appended as the text
the template adds for them plus the next generation prompt, tokenised (`tunebook.rl.tool_calls.observation_text`).
`loss_mask` is 1 on the model's tokens and 0 on the environment's, which never carry loss; the engine's log-probs
are kept for the model's tokens only, in order.

Turn t of a completion samples with `turn_seed(seed, t)` (turn 0: the completion's own seed, so an episode that ends
after one turn is the single-turn completion), so an episode is the same whatever shares its batch, and a resumed
run replays it. An episode ends when the environment says done, after `max_tool_calling_iterations` rounds of tool
results (TRL's name), or when its completion (model and environment tokens) would pass `max_episode_tokens`: a turn
generates at most what is left, and tool results that leave no room are not appended (both counted as truncated).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..data.tokenize import render_chat
from ..errors import ConfigError, TunebookError
from ..user_code import load_function, user_failure
from .environments import Environment, ToolEnvironment, load_tools
from .generation import Generated, GenerationBackend, Sampling, stop_id_tuple
from .grpo import sample_completions
from .tool_calls import ToolCallFormat, observation_text

__all__ = ["EpisodeRunner", "Episodes", "GreedyBackend", "load_episodes", "run_episodes", "turn_seed"]


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of a completion's turn `turn` (0: the completion's own seed)."""
    return seed if turn == 0 else ((seed * 1_000_003 + turn) * 2_654_435_761) % (2**63 - 1)


@dataclass
class Episodes:
    """One entry per episode (completion), in the order of the rows given."""

    prompt_ids: list[list[int]]
    token_ids: list[list[int]]  # the completion: model turns and environment tokens, in order
    loss_mask: list[list[int]]  # 1 on the model's tokens, 0 on the environment's
    log_probs: list[list[float]] | None  # the engine's, of the model's tokens only
    messages: list[list[dict[str, Any]]]  # the episode as messages: the opening, the turns, the observations
    texts: list[str] = field(default_factory=list)  # the final answer: the last model turn's text outside tool calls
    rewards: list[float] = field(default_factory=list)  # the environment's per-turn rewards, summed
    turns: list[int] = field(default_factory=list)
    tool_calls: list[int] = field(default_factory=list)
    tool_failures: list[int] = field(default_factory=list)  # tool messages that are errors ("error: ...")
    truncated: list[bool] = field(default_factory=list)

    def model_lengths(self) -> list[int]:
        return [sum(mask) for mask in self.loss_mask]

    def stats(self) -> dict[str, float]:
        """Sums for `GRPOStats.add`."""
        return {"episodes": len(self.turns), "turns": sum(self.turns), "tool_calls": sum(self.tool_calls),
                "episodes_with_calls": sum(c > 0 for c in self.tool_calls),
                "tool_failures": sum(self.tool_failures), "truncated": sum(self.truncated)}  # fmt: skip


def run_episodes(backend: GenerationBackend, environment: Environment, rows: list[dict[str, Any]], seeds: list[int],
                 sampling: Sampling, tokenizer, tool_format: ToolCallFormat, *,
                 max_tool_calling_iterations: int | None, max_episode_tokens: int) -> Episodes:  # fmt: skip
    """Run one episode per row (repeat a row for several), turn by turn, every unfinished episode's turn in one
    `backend.generate` call; see the module docstring."""
    n, tools = len(rows), getattr(environment, "tools", None) or None
    messages = [environment.reset(row) for row in rows]
    prompts = [_ids(tokenizer, render_chat(tokenizer, m, tools, generation_prompt=True)) for m in messages]
    ep = Episodes(prompts, [[] for _ in rows], [[] for _ in rows], [[] for _ in rows], messages, [""] * n,
                  [0.0] * n, [0] * n, [0] * n, [0] * n, [False] * n)  # fmt: skip
    stops = set(sampling.stop_token_ids)
    active, turn = list(range(n)), 0
    while active:
        budgets = [min(sampling.max_new_tokens, max_episode_tokens - len(ep.token_ids[i])) for i in active]
        out = backend.generate([prompts[i] + ep.token_ids[i] for i in active], [turn_seed(seeds[i], turn) for i in active],
                               replace(sampling, max_new_tokens=max(budgets)))  # fmt: skip
        if out.log_probs is None:
            ep.log_probs = None
        going = []
        for k, (i, budget) in enumerate(zip(active, budgets)):
            tokens = out.token_ids[k][:budget]  # a batch's longest budget: each turn cut to its own episode's
            ep.token_ids[i] += tokens
            ep.loss_mask[i] += [1] * len(tokens)
            if ep.log_probs is not None:
                ep.log_probs[i] += out.log_probs[k][: len(tokens)]
            ep.turns[i] += 1
            ended = bool(tokens) and tokens[-1] in stops
            body = tokens[:-1] if ended else tokens
            content, calls, invalid = tool_format.parse(tokenizer.decode(body, skip_special_tokens=False))
            message = {"role": "assistant", "content": content}
            message.update(
                {"tool_calls": calls} if calls else {}, **({"invalid_tool_calls": invalid} if invalid else {})
            )
            messages[i].append(message)
            ep.texts[i] = tool_format.parse(tokenizer.decode(body, skip_special_tokens=True))[0]
            ep.tool_calls[i] += len(calls) + len(invalid)
            if not ended:  # out of tokens mid-turn (max_new_tokens, or the episode's budget)
                ep.truncated[i] = True
                continue
            observation, reward, done = environment.step(messages[i])
            ep.rewards[i] += float(reward or 0.0)
            ep.tool_failures[i] += sum(str(m.get("content", "")).startswith("error:") for m in observation)
            if done:
                continue
            if max_tool_calling_iterations is not None and ep.turns[i] > max_tool_calling_iterations:
                ep.truncated[i] = True
                continue
            stop_text = tokenizer.decode([tokens[-1]], skip_special_tokens=False)
            suffix = _ids(tokenizer, observation_text(tokenizer, tools or [], observation, stop_text))
            if len(ep.token_ids[i]) + len(suffix) >= max_episode_tokens:  # no room left for the model's next turn
                ep.truncated[i] = True
                continue
            ep.token_ids[i] += suffix
            ep.loss_mask[i] += [0] * len(suffix)
            messages[i].extend(observation)
            going.append(i)
        active, turn = going, turn + 1
    return ep


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote the special tokens


class GreedyBackend(GenerationBackend):
    """Greedy decoding with the policy's `generate` (evaluation's episodes): no noise, no log-probs."""

    name = "greedy"
    samples_with_trainer = True

    def __init__(self, model, device):
        self.model, self.device = model, device

    def generate(self, prompt_ids, seeds, sampling: Sampling, images=None) -> Generated:
        return Generated(sample_completions(self.model, prompt_ids, seeds, pad_token_id=sampling.pad_token_id,
                                            eos_token_id=list(sampling.stop_token_ids), device=self.device,
                                            max_new_tokens=sampling.max_new_tokens, temperature=1.0, top_p=1.0,
                                            greedy=True))  # fmt: skip


@dataclass
class EpisodeRunner:
    """What a run's episodes share: the environment, the template's tool format, sampling and the limits."""

    environment: Environment
    tokenizer: Any
    tool_format: ToolCallFormat
    sampling: Sampling
    max_tool_calling_iterations: int | None
    max_episode_tokens: int

    @property
    def tools(self) -> list[dict] | None:
        """The tool definitions every episode's prompt holds."""
        return getattr(self.environment, "tools", None) or None

    def run(self, backend: GenerationBackend, batch: dict[str, list], repeat: int, seeds: list[int]) -> Episodes:
        """Episodes of a `PromptRows` batch's rows, each `repeat` times in a row (a group), one seed each."""
        rows = [{k: v[j] for k, v in batch.items()} for j in range(len(batch["prompt"])) for _ in range(repeat)]
        return run_episodes(backend, self.environment, rows, seeds, self.sampling, self.tokenizer, self.tool_format,
                            max_tool_calling_iterations=self.max_tool_calling_iterations,
                            max_episode_tokens=self.max_episode_tokens)  # fmt: skip


def load_episodes(config, tokenizer, stop_token_ids) -> EpisodeRunner | None:
    """The runner of a GRPO config's episodes (`tools`, or `environment`), or None: single-turn completions."""
    if not (config.tools or config.environment):
        return None
    sampling = Sampling(config.max_new_tokens, config.temperature, config.top_p, stop_id_tuple(stop_token_ids),
                        tokenizer.pad_token_id)  # fmt: skip
    environment = ToolEnvironment(load_tools(config.tools)) if config.tools else _user_environment(config.environment)
    return EpisodeRunner(environment, tokenizer, ToolCallFormat.from_template(tokenizer), sampling,
                         config.max_tool_calling_iterations, config.episode_tokens())  # fmt: skip


def _user_environment(spec: str) -> Environment:
    try:
        environment = load_function(spec, "environment")()
    except (TunebookError, KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as error:  # the user's code, in one line
        raise ConfigError(f"environment {spec!r}: calling it raised {user_failure(error)}") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(environment, m, None))]
    if missing:
        raise ConfigError(f"environment {spec!r}: returned a {type(environment).__name__} without {' or '.join(missing)}"
                          "; return a tunebook.rl.environments.Environment")  # fmt: skip
    return environment
