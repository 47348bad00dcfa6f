"""Group Relative Policy Optimization (GRPO) of a causal language model with verifiable rewards.

With no arguments it runs the embedded offline default: the SFT default's digit task as prompts with reference
answers, a locally trained tokenizer and a tiny Llama that a short SFT warm-up first teaches the answer format;
then GRPO samples 8 completions per prompt, rewards exact matches, and reports the held-out exact match of greedy
answers when GRPO starts and at the end. A vision-language model takes prompts with images the same way
(recipes/configs/grpo/vlm_default.yaml): completions are generated and scored with them (rewards get `images`).
With `tools` a completion is a multi-turn episode, the model's turns with the tools' results (no loss) between them
(`tunebook.rl.episodes`; recipes/configs/grpo/tools_default.yaml: a tiny model learns to call a calculator).

    tunebook train --config_file accelerate_configs/cpu.yaml grpo                                # CPU
    tunebook train --config_file accelerate_configs/multi_cpu.yaml grpo                          # 2 CPU processes
    tunebook train --config_file accelerate_configs/single_gpu.yaml grpo \\
        --model_name_or_path outputs/my-sft-model --train_data prompts.jsonl \\
        --reward_functions '[exact_match, my_rewards.py:format_ok]' --max_new_tokens 512          # one GPU

Each row of the data has a `prompt` (text or messages); its other columns reach the reward functions. Every
optimizer step: the window's prompts (each process its own, whole groups) -> `num_generations` sampled completions
each, from the policy's own `generate` or vLLM (`use_vllm`; `async_generation` samples the next window while this
one trains) -> rewards -> advantages within each group (`tunebook.rl.rollouts`) -> `num_iterations` updates of the
clipped objective (`tunebook.rl.grpo`), each token weighted by pi_trainer / pi_sampler where the sampler was not the
trained module. Outputs in `output_dir` as for the other recipes; `metrics.jsonl` adds reward mean/std per function,
the fraction of groups with one reward for all, completion lengths, clip ratio, KL, the sampler-vs-trainer
mismatch, and generation vs. training seconds.
"""

from __future__ import annotations

import time

import torch

from tunebook.config import GRPOConfig, load_config
from tunebook.data import train_and_eval_loaders
from tunebook.distributed import prepare_then_join
from tunebook.evaluation import log_samples, prompt_sampler
from tunebook.models import apply_lora, build_chat_lm, describe_parameters, whole_weights
from tunebook.preference import frozen_copy, partition_reference
from tunebook.rl import PromptData, PromptRows, load_episodes, prepare_prompt_data
from tunebook.rl.engines import make_backend
from tunebook.rl.evaluation import evaluate_completions
from tunebook.rl.grpo import completion_log_probs, grpo_token_losses, loss_numerator, step_normaliser, stop_tokens
from tunebook.rl.rewards import describe, load_reward_functions
from tunebook.rl.rollouts import PendingRollouts, RolloutSource
from tunebook.rl.stats import GRPOStats
from tunebook.rl.vision_prompts import VisionPromptRows, warm_up
from tunebook.training import (
    accumulation_windows,
    after_step,
    build_optimizer,
    build_scheduler,
    compile_model,
    epochs,
    finish,
    finite_on_every_process,
    load_checkpoint_or_start,
    micro_batch,
    optimizer_step_or_skip,
    plan_steps,
    start_run,
    start_training,
    step_loss_scale,
)


def evaluate(config: GRPOConfig, model, data: PromptData, rewards, accelerator, log, step: int, episodes) -> dict:
    metrics, samples = evaluate_completions(
        model,
        data.tokenizer,
        data.eval,
        rewards,
        accelerator,
        batch_size=config.per_device_eval_batch_size,
        max_new_tokens=config.max_new_tokens,
        reference_column=config.reference_column,
        disable_tqdm=config.disable_tqdm,
        when=f"in the evaluation after step {step}" if step else "in the evaluation before training",
        collate_fn=VisionPromptRows(data.processor, 1, config.max_image_pixels) if data.processor else None,
        processor=data.processor,
        episodes=episodes,
    )
    log_samples(log, samples, step)
    return metrics


def main(config: GRPOConfig) -> dict:
    run = start_run(config, "grpo")  # Accelerator, logging, seed, output_dir locked
    accelerator, log = run.accelerator, run.log

    # --- data: prompts (and their other columns, for the rewards), prepared under a file lock, then all meet
    data = prepare_then_join(accelerator, config, prepare_prompt_data, run.cache_dir, log)
    tokenizer = data.tokenizer

    # --- model: the policy (a VLM's tower frozen); optionally a brief SFT warm-up; the reference for the KL
    model = build_chat_lm(tokenizer, data.processor, config)
    episodes = load_episodes(config, tokenizer, stop_tokens(model, tokenizer))  # tools: multi-turn episodes
    with whole_weights(model):  # under DeepSpeed ZeRO-3 the model is built partitioned: whole until prepare
        if config.sft_warmup_steps:
            warm_up(config, model, data, accelerator.device, log, episodes and episodes.tools)
        reference = None  # beta 0: none; with LoRA: the policy with its adapters off
        if config.beta > 0 and not config.use_peft:
            reference = frozen_copy(model, accelerator.device)
    if config.use_peft:  # LoRA: the base stays frozen; checkpoints and the output hold only the adapters
        model = apply_lora(model, config)  # a VLM's all-linear: its language model's layers
    log.info("Model: %s, %s", type(model).__name__, describe_parameters(model))
    rewards = load_reward_functions(config, accelerator.device)
    log.info("Rewards: %s", describe(rewards, config))  # and completions per prompt, loss, advantages' scale

    # --- optimizer, loaders
    optimizer = build_optimizer(
        model, config.learning_rate, config.weight_decay, (config.adam_beta1, config.adam_beta2), config.adam_epsilon
    )
    collate = PromptRows()  # a VLM's: its images decoded in the loader's workers, once for a group's completions
    if data.processor is not None:
        collate = VisionPromptRows(data.processor, config.num_generations, config.max_image_pixels)
    train_loader, _ = train_and_eval_loaders(config, data.train, None, collate)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    reference = partition_reference(accelerator, reference)  # under ZeRO-3 sharded as the policy is
    plan = plan_steps(run, model, train_loader, "prompts", updates_per_window=config.num_iterations)
    compiled = compile_model(config, accelerator, model, train_loader, plan.micro_batches, log)  # torch_compile
    schedule = build_scheduler(config.lr_scheduler_type, optimizer, plan.total_steps, config.warmup_ratio)
    lr_scheduler = accelerator.prepare(schedule)

    # --- resume (or start), then train: the loop's bookkeeping is tunebook.training.loop
    def run_evaluation() -> dict:
        return evaluate(config, model, data, rewards, accelerator, log, saved.state.global_step, episodes)

    evaluation = run_evaluation if data.eval is not None else None
    figures = GRPOStats(accelerator.device, [f.name for f in rewards])
    pending = PendingRollouts()  # a checkpoint keeps the rollouts in flight: between updates, or generated ahead
    saved = load_checkpoint_or_start(
        run, optimizer, lr_scheduler, train_loader, figures, evaluation is not None, pending_rollouts=pending
    )
    # --- generation: the policy's own generate, or vLLM (colocated or a server), each step or one step ahead
    backend = make_backend(config, model, accelerator, data, log)
    source = RolloutSource(  # tools (episodes): each completion a multi-turn episode
        config, accelerator, backend, model, reference, rewards, figures, data, pending, saved, episodes
    )
    samples = prompt_sampler(config, model, tokenizer, accelerator)  # sample_prompts, at each evaluation
    loop = start_training(
        run, plan, saved, model, optimizer, lr_scheduler, train_loader, data, evaluation, compiled, samples
    )
    model.train()
    k, device = config.gradient_accumulation_steps, accelerator.device
    clip_range = (config.epsilon, config.epsilon_high)
    for loader in epochs(run, loop):
        for window, upcoming in source.windows(accumulation_windows(loader, k, run.timer)):
            # Sample, score, compare within groups once (async: the next window meanwhile); num_iterations updates.
            first, rollouts = source.next(window, upcoming, loop.state.global_step)
            # The loss is normalised over the whole step (all micro-batches and processes), per loss_type.
            normaliser, tokens = step_normaliser(rollouts, config.loss_type, config.episode_tokens(), accelerator)
            scale = step_loss_scale(normaliser, accelerator.num_processes, k)
            ended = False
            for iteration in range(first, config.num_iterations):
                start = time.perf_counter()
                step_loss = torch.zeros((), dtype=torch.float64, device=device)
                clipped = kl = torch.zeros((), device=device)
                for r in rollouts:
                    with micro_batch(accelerator, model, last=r is rollouts[-1]):
                        log_probs, rows = completion_log_probs(model, r, config.temperature)
                        old = log_probs.detach() if r.old_log_probs is None else r.old_log_probs
                        weights = source.weights(r, old, rows, first_update=iteration == 0)  # pi_trainer / pi_sampler
                        token_losses, token_clipped, token_kl = grpo_token_losses(
                            log_probs, old, r.advantages[rows], *clip_range, config.beta, r.ref_log_probs, weights
                        )
                        numerator = loss_numerator(token_losses, rows, r.completion_lengths, config.loss_type)
                        accelerator.backward(numerator * scale)
                    step_loss += (numerator.detach() / normaliser).double()
                    clipped, kl = clipped + token_clipped.sum(), kl + token_kl.sum()
                    loop.counters.add_batch({"attention_mask": r.attention_mask})  # tokens, completions trained
                pending.keep(iteration, rollouts, config.num_iterations)  # what a checkpoint here needs
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm or float("inf"))
                finite = finite_on_every_process(step_loss, grad_norm, accelerator)
                updated = optimizer_step_or_skip(run, loop.state, optimizer, finite)  # fp16: the scaler's step
                learning_rate = lr_scheduler.get_last_lr()[0]  # the rate this step trained at
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                if updated:
                    figures.add(
                        steps=1,
                        loss=step_loss,
                        trained_tokens=tokens / accelerator.num_processes,
                        clipped=clipped,
                        kl=kl,
                        training_seconds=time.perf_counter() - start,
                    )
                last = iteration == config.num_iterations - 1  # the data moves on after the last update only
                ended = after_step(run, loop, window, grad_norm, learning_rate, data_advanced=last)
                if ended:
                    break
            if ended:
                break

    source.close()  # a generation in flight finishes; the engine is released
    # --- final evaluation (the best checkpoint's weights with load_best_model_at_end) and outputs
    return finish(run, loop, headline=("eval_exact_match", "exact match", ".3f"))


if __name__ == "__main__":
    main(load_config(GRPOConfig))
