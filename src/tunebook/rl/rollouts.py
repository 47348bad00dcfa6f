"""Where GRPO's rollouts come from each step: a window of prompts -> the backend's completions -> rewards ->
advantages within each group -> the log-probs the loss compares with.

Synchronous (the default): before a window is sampled, the engine gets the policy's weights if an optimizer step
changed them since it last did; completions of step n come from the weights after step n - 1 (on-policy).

`async_generation: true`: the next window is sampled in a background thread while this one trains, so step n+1's
completions come from the weights after step n - 1, one step behind (bounded: the thread starts only after the
engine has the weights of the step before, and is waited for before the engine gets new ones). The importance
weights (`tunebook.rl.mismatch`) correct for it. Only the engine's sampling runs in the thread: rewards,
advantages (a collective), and the trainer's log-probs stay on the main thread.

A checkpoint keeps what is in flight (`PendingRollouts`): rollouts between the `num_iterations` updates of one
window, and the next window's completions (waited for at the save), so a resumed run trains on exactly what the
uninterrupted one would have.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..models.wrappers import unwrap
from .episodes import Episodes
from .generation import Generated, GenerationBackend, Sampling, stop_id_tuple
from .grpo import Rollouts, completion_log_probs, completion_seed, group_advantages, rollout_rows, stop_tokens
from .mismatch import importance_weights
from .prompts import reward_inputs
from .rewards import combined, score
from .vision_prompts import prompt_images

__all__ = ["PendingRollouts", "RolloutSource"]


@dataclass
class _Sampled:
    """One micro-batch's completions as the engine gave them, with how long that took; with tools, the multi-turn
    episodes they are (`tunebook.rl.episodes.Episodes`: their prompts, loss masks, answers, environment rewards)."""

    generated: Generated
    seconds: float
    episodes: Episodes | None = None

    def state(self) -> list:
        return [[self.generated.token_ids, self.generated.log_probs], self.seconds,
                None if self.episodes is None else asdict(self.episodes)]  # fmt: skip

    @classmethod
    def from_state(cls, state: list) -> _Sampled:
        generated, seconds, *rest = state
        episodes = Episodes(**rest[0]) if rest and rest[0] is not None else None
        return cls(Generated(*generated), seconds, episodes)


class RolloutSource:
    """Windows of prompts in, scored `Rollouts` out (see the module docstring). `saved`: the run's checkpointed state
    (`load_checkpoint_or_start`), or the optimizer step it starts at."""

    def __init__(self, config, accelerator, backend: GenerationBackend, model, reference, rewards, figures, data,
                 pending: PendingRollouts, saved, episodes=None):  # fmt: skip
        self.config, self.accelerator, self.backend = config, accelerator, backend
        self.model, self.reference, self.rewards, self.figures, self.data = model, reference, rewards, figures, data
        self.pending, self.episodes = pending, episodes  # episodes: a `tunebook.rl.episodes.EpisodeRunner` (tools)
        self.correct = config.vllm_importance_sampling_correction and not backend.samples_with_trainer
        policy = unwrap(model)
        self.sampling = Sampling(
            max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_p=config.top_p,
            stop_token_ids=stop_id_tuple(stop_tokens(policy, data.tokenizer)),
            pad_token_id=data.tokenizer.pad_token_id,
        )  # fmt: skip
        # the weights the engine holds: those it started from (the run's, resumed or not), or none it got from us
        step = saved.state.global_step if hasattr(saved, "state") else int(saved)
        self.pushed_at = step if backend.starts_from_policy else None
        self.async_ = bool(config.async_generation)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-generation") if self.async_ else None

    # --- the windows, each with the next (async)
    def windows(self, windows):
        """(window, the next window or None): async generation samples the next while this one trains."""
        if not self.async_:
            for window in windows:
                yield window, None
            return
        iterator = iter(windows)
        current = next(iterator, None)
        while current is not None:
            upcoming = next(iterator, None)
            yield current, upcoming
            current = upcoming

    def next(self, window, upcoming, step: int) -> tuple[int, list[Rollouts]]:
        """(the first update's index, the rollouts) for `window` at optimizer step `step`."""
        kept = self.pending.take(self.accelerator.device)
        if kept is not None:  # resumed between the updates of this window: its rollouts, and any ahead, kept
            return kept
        sampled = self._ahead_for(window)
        if sampled is None:
            self._push(step)
            sampled = self._sample(window, step)
        if upcoming is not None:
            self._push(step)  # the next window samples from this step's starting weights: one step behind
            self.pending.ahead = self.thread.submit(self._sample, upcoming, step + self.config.num_iterations)
        return 0, self._score(window, sampled, step)

    def _ahead_for(self, window) -> list[_Sampled] | None:
        ahead, self.pending.ahead = self.pending.ahead, None
        if ahead is None:
            return None
        start = time.perf_counter()
        sampled = ahead.result() if isinstance(ahead, Future) else [_Sampled.from_state(s) for s in ahead]
        self.figures.add(waiting_seconds=time.perf_counter() - start)
        if len(sampled) != len(window):
            raise RuntimeError("the completions generated ahead do not match the window they were made for")
        return sampled

    def _push(self, step: int) -> None:
        if self.pushed_at != step:
            self.backend.push_weights(self.model, self.accelerator)
            self.pushed_at = step

    def _sample(self, window, step: int) -> list[_Sampled]:
        """The engine's completions of a window's prompts (thread-safe: no collectives, no trainer forward)."""
        G, out = self.config.num_generations, []
        for batch in window:
            start = time.perf_counter()
            prompt_ids = [p for p in batch["prompt_ids"] for _ in range(G)]  # a group's completions stay together
            seeds = [completion_seed(self.config.seed, step, int(row), g) for row in batch["row"] for g in range(G)]
            if self.episodes is not None:  # multi-turn: the model's turns, the tools' results (no loss) between them
                ran = self.episodes.run(self.backend, batch, G, seeds)
                out.append(_Sampled(Generated(ran.token_ids, ran.log_probs), time.perf_counter() - start, ran))
                continue
            images = prompt_images(batch, self.data.processor)  # a VLM's: each prompt's images, per completion
            generated = self.backend.generate(prompt_ids, seeds, self.sampling, images=images)
            out.append(_Sampled(generated, time.perf_counter() - start))
        return out

    # --- rewards, advantages and the trainer's log-probs (main thread)
    def _score(self, window, sampled: list[_Sampled], step: int) -> list[Rollouts]:
        accelerator, G, tokenizer = self.accelerator, self.config.num_generations, self.data.tokenizer
        parts = []
        for batch, s in zip(window, sampled):
            completions, ran = s.generated.token_ids, s.episodes
            texts = ran.texts if ran else tokenizer.batch_decode(completions, skip_special_tokens=True)
            prompts, columns = reward_inputs(batch, completions, G, ran)
            when = f"at step {step + 1}"  # what a failing reward's error says
            per_function = score(self.rewards, prompts, texts, columns, accelerator.device, when)
            self.figures.add_rewards(per_function)
            total = combined(per_function, self.rewards)
            if ran:  # the environment's per-turn rewards, summed over the episode
                total = total + torch.tensor(ran.rewards, dtype=total.dtype, device=total.device)
            parts.append((batch, s, total))
        # scale_rewards batch: the std over the whole generation batch, every process's completions included.
        batch_std = accelerator.gather(torch.cat([part[2] for part in parts])).std()
        rollouts = []
        for batch, s, total in parts:
            rollouts.append(self._rollouts(batch, s, total, batch_std))
        return rollouts

    def _rollouts(self, batch, s: _Sampled, total: torch.Tensor, batch_std) -> Rollouts:
        config, G, device = self.config, self.config.num_generations, self.accelerator.device
        ran, completions = s.episodes, s.generated.token_ids
        prompt_ids = ran.prompt_ids if ran else [p for p in batch["prompt_ids"] for _ in range(G)]
        advantages, zero_std = group_advantages(total, G, config.scale_rewards, batch_std)
        rows = rollout_rows(prompt_ids, completions, self.data.tokenizer.pad_token_id, device, ran and ran.loss_mask)
        images = prompt_images(batch, self.data.processor)
        r = Rollouts(*rows, advantages, None, None, images and images.inputs(rows[0]))
        if s.generated.log_probs is not None:  # in loss-position order: each completion's model tokens, row by row
            flat = [x for row in s.generated.log_probs for x in row]
            r.sampler_log_probs = torch.tensor(flat, dtype=torch.float32, device=device)
        policy = unwrap(self.model)
        with torch.no_grad():
            if config.num_iterations > 1:  # later updates compare with the policy that sampled
                r.old_log_probs = completion_log_probs(self.model, r, config.temperature)[0]
            if config.beta > 0 and self.reference is None:  # LoRA: the reference is the policy with adapters off
                with policy.disable_adapter():
                    r.ref_log_probs = completion_log_probs(self.model, r, config.temperature)[0]
            elif config.beta > 0:
                r.ref_log_probs = completion_log_probs(self.reference, r, config.temperature)[0]
        self.figures.add(
            completions=len(completions), reward=total.sum(), reward_sq=(total**2).sum(),
            zero_std_groups=zero_std.sum(), groups=len(completions) // G, tokens=r.completion_lengths.sum(),
            max_length=r.completion_lengths.max(), generation_seconds=s.seconds,
            **(ran.stats() if ran else {}),  # tool calls, turns, truncated episodes
        )  # fmt: skip
        return r

    # --- the loss's importance weights
    def weights(self, r: Rollouts, old: torch.Tensor, rows: torch.Tensor, first_update: bool):
        """The importance weights of `r`'s tokens (None where not corrected): computed at the first update from the
        trainer's log-probs of the weights the rollouts are first trained on (`old`), kept for the later ones; the
        mismatch figures are recorded then too."""
        if r.sampler_log_probs is None:
            return None
        if first_update or (self.correct and r.importance_weights is None):
            weights = None
            if self.correct:
                c = self.config
                weights = importance_weights(old, r.sampler_log_probs, rows, len(r.advantages),
                                             c.vllm_importance_sampling_mode, c.vllm_importance_sampling_clip_min,
                                             c.vllm_importance_sampling_clip_max)  # fmt: skip
                r.importance_weights = weights
            self.figures.add_mismatch(old.detach(), r.sampler_log_probs, weights)
        return r.importance_weights if self.correct else None

    def close(self) -> None:
        """Wait for a generation in flight, then release the engine."""
        if self.thread is not None:
            self.thread.shutdown(wait=True)
        self.backend.close()


class PendingRollouts:
    """What a checkpoint must keep of the rollouts in flight (registered for checkpointing, this process's): the
    rollouts still to train on when it falls between the `num_iterations` updates of one window, and with async
    generation the next window's completions (waited for at the save), so a run resumed there trains on them."""

    def __init__(self):
        # as loaded from a checkpoint: {"iteration": i, "rollouts": [Rollouts.state_dict(), ...]}
        self.pending: dict[str, Any] | None = None
        # (the next update's index, the rollouts) since the last update: turned into lists only when a checkpoint is
        # saved, not after every update (a VLM's pixel values are millions of numbers)
        self._kept: tuple[int, list[Rollouts]] | None = None
        # async generation: the next window's completions, in flight (a Future) or as loaded (`_Sampled.state`s)
        self.ahead: Future | list | None = None

    def keep(self, iteration: int, rollouts: list[Rollouts], iterations: int) -> None:
        """After update `iteration` of a generation batch: the rollouts a checkpoint must keep (none after the
        last update)."""
        self._kept = None if iteration + 1 == iterations else (iteration + 1, rollouts)
        self.pending = None

    def take(self, device) -> tuple[int, list[Rollouts]] | None:
        """(the next update's index, the rollouts) kept by `keep` in the checkpoint resumed from, or None."""
        if not self.pending or "rollouts" not in self.pending:
            return None
        pending, self.pending = self.pending, None
        return pending["iteration"], [Rollouts.from_state_dict(r, device) for r in pending["rollouts"]]

    def state_dict(self) -> dict[str, Any] | None:
        state = dict(self.pending or {})
        if self._kept is not None:
            iteration, rollouts = self._kept
            state = {"iteration": iteration, "rollouts": [r.state_dict() for r in rollouts]}
        if self.ahead is not None:
            sampled = self.ahead.result() if isinstance(self.ahead, Future) else None
            state["ahead"] = self.ahead if sampled is None else [s.state() for s in sampled]
        return state or None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = dict(state or {})
        self.ahead = state.pop("ahead", None)
        self.pending, self._kept = state or None, None
