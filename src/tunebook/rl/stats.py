"""GRPO's logged figures: running sums over a logging window on each process, turned into means at the log.

Next to the reward and loss figures, where the completions were sampled by something other than the trained
module (vLLM, or async generation's copy one step behind) the sampler-vs-trainer mismatch, with TRL's names:
`sampling/sampling_logp_difference/mean` and `/max` (|log pi_trainer - log pi_sampler| over the sampled tokens),
`sampling/kl` (KL(sampler || trainer), the k3 estimate over the same tokens) and
`sampling/importance_sampling_ratio/min|mean|max` (the weights the loss used); and the time generation took, the
time training took and the time training waited for generation (async: what the overlap did not hide); with tools, TRL's
`tools/call_frequency` and `tools/failure_frequency`, `tools/call_rate`, `episodes/turns` and `episodes/truncated`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["GRPOStats"]


class GRPOStats:
    """Running sums of a logging window (this process) for the logged figures."""

    FIELDS = ("steps", "loss", "completions", "reward", "reward_sq", "zero_std_groups", "groups", "tokens",
              "max_length", "trained_tokens", "clipped", "kl", "generation_seconds", "training_seconds",
              "waiting_seconds", "sampled_tokens", "logp_difference", "max_logp_difference", "sampler_kl",
              "is_ratio", "is_ratio_count", "max_is_ratio", "max_negative_is_ratio",
              # multi-turn episodes with tools (`tunebook.rl.episodes.Episodes.stats`)
              "episodes", "turns", "tool_calls", "episodes_with_calls", "tool_failures", "truncated")  # fmt: skip
    # reduced by their maximum, not summed (a minimum is kept as the maximum of its negative)
    MAXIMA = ("max_length", "max_logp_difference", "max_is_ratio", "max_negative_is_ratio")

    def __init__(self, device, reward_names: list[str]):
        self.reward_names = reward_names
        self.sums = torch.zeros(len(self.FIELDS) + 3 * len(reward_names), dtype=torch.float64, device=device)
        self._reset_maxima()

    def _reset_maxima(self) -> None:
        for key in self.MAXIMA:  # an empty window's maximum is "none", not 0 (a ratio's minimum may be above 0)
            self.sums[self.FIELDS.index(key)] = -math.inf if key != "max_length" else 0.0

    def add(self, **values: float | torch.Tensor) -> None:
        for key, value in values.items():
            i = self.FIELDS.index(key)
            value = torch.as_tensor(value, dtype=torch.float64, device=self.sums.device)
            if key in self.MAXIMA:
                self.sums[i] = torch.maximum(self.sums[i], value)
            else:
                self.sums[i] += value

    def add_mismatch(self, trainer: torch.Tensor, sampler: torch.Tensor, weights: torch.Tensor | None) -> None:
        """The sampled tokens' log-probs under the trainer and the sampler (flat, detached), and the importance
        weights the loss used (None: not corrected)."""
        if trainer.numel() == 0:
            return
        delta = (trainer - sampler).double()
        self.add(sampled_tokens=delta.numel(), logp_difference=delta.abs().sum(), max_logp_difference=delta.abs().max(),
                 sampler_kl=(torch.exp(delta) - delta - 1).sum())  # fmt: skip
        if weights is not None:
            weights = weights.double()
            self.add(is_ratio=weights.sum(), is_ratio_count=weights.numel(), max_is_ratio=weights.max(),
                     max_negative_is_ratio=-weights.min())  # fmt: skip

    def add_rewards(self, per_function: torch.Tensor) -> None:
        """per_function: (completions, functions) with NaN where a function gave None."""
        base = len(self.FIELDS)
        present = ~torch.isnan(per_function)
        values = torch.nan_to_num(per_function).double()
        for j in range(len(self.reward_names)):
            self.sums[base + 3 * j] += present[:, j].sum()
            self.sums[base + 3 * j + 1] += values[:, j].sum()
            self.sums[base + 3 * j + 2] += (values[:, j] ** 2).sum()

    def local_loss(self) -> float | None:
        """This process's mean loss of the window so far, without ending it (the timed progress line)."""
        steps, loss = self.sums[:2].tolist()
        return loss / steps if steps else None

    def pop(self, accelerator, prefix: str = "") -> dict[str, float | None]:
        n = len(self.FIELDS)
        gathered = accelerator.gather(self.sums[None].clone())  # (processes, fields): sums, and some maxima
        self.sums.zero_()
        self._reset_maxima()
        s = dict(zip(self.FIELDS, gathered[:, :n].sum(dim=0).tolist()))
        for key in self.MAXIMA:
            s[key] = float(gathered[:, self.FIELDS.index(key)].max())
        s["steps"] /= accelerator.num_processes  # every process counts each step; the loss is summed over them
        rewards = gathered[:, n:].sum(dim=0)
        if s["steps"] == 0:
            return {"loss": None}
        completions, tokens = max(s["completions"], 1.0), max(s["trained_tokens"], 1.0)
        out = {
            "loss": s["loss"] / s["steps"],
            "reward": s["reward"] / completions,
            "reward_std": math.sqrt(max(s["reward_sq"] / completions - (s["reward"] / completions) ** 2, 0.0)),
        }
        values = rewards.tolist()
        for j, name in enumerate(self.reward_names):
            count, total, squares = values[3 * j : 3 * j + 3]
            mean = total / max(count, 1.0)
            out[f"rewards/{name}/mean"] = mean
            out[f"rewards/{name}/std"] = math.sqrt(max(squares / max(count, 1.0) - mean**2, 0.0))
        out.update({
            "frac_reward_zero_std": s["zero_std_groups"] / max(s["groups"], 1.0),
            "completions/mean_length": s["tokens"] / completions,
            "completions/max_length": s["max_length"],
            "clip_ratio": s["clipped"] / tokens,
            "kl": s["kl"] / tokens,
            "generation_seconds": s["generation_seconds"],
            "training_seconds": s["training_seconds"],
        })  # fmt: skip
        if s["episodes"]:  # TRL's tools/call_frequency (calls per episode) and tools/failure_frequency (per call)
            episodes = s["episodes"]
            out.update({"tools/call_frequency": s["tool_calls"] / episodes,
                        "tools/call_rate": s["episodes_with_calls"] / episodes,
                        "tools/failure_frequency": s["tool_failures"] / max(s["tool_calls"], 1.0),
                        "episodes/turns": s["turns"] / episodes, "episodes/truncated": s["truncated"] / episodes})  # fmt: skip
        if s["waiting_seconds"] > 0:
            out["waiting_seconds"] = s["waiting_seconds"]
        if s["sampled_tokens"] > 0:
            out.update({
                "sampling/sampling_logp_difference/mean": s["logp_difference"] / s["sampled_tokens"],
                "sampling/sampling_logp_difference/max": s["max_logp_difference"],
                "sampling/kl": s["sampler_kl"] / s["sampled_tokens"],
            })  # fmt: skip
        if s["is_ratio_count"] > 0:
            out.update({
                "sampling/importance_sampling_ratio/mean": s["is_ratio"] / s["is_ratio_count"],
                "sampling/importance_sampling_ratio/min": -s["max_negative_is_ratio"],
                "sampling/importance_sampling_ratio/max": s["max_is_ratio"],
            })  # fmt: skip
        return {prefix + k: v for k, v in out.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"sums": self.sums.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sums = torch.tensor(state["sums"], dtype=torch.float64)
        if sums.numel() == 14 + 3 * len(self.reward_names):  # a checkpoint from before the sampling and tool figures
            old = 14
            sums = torch.cat([sums[:old], self.sums[old : len(self.FIELDS)].cpu(), sums[old:]])
        self.sums.copy_(sums)
