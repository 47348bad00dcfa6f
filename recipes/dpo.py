"""Direct Preference Optimization (DPO) of a causal language model on (prompt, chosen, rejected) pairs.

With no arguments it runs the embedded offline default: it generates preference pairs over the SFT default's digit
task (the right answer chosen, a near miss rejected), trains a tokenizer locally, builds a tiny Llama, teaches it
the task format with a brief SFT warm-up on the chosen answers, then runs DPO against a frozen copy of that model
and reports the reward accuracy on held-out pairs before and after. A vision-language model
(`AutoModelForImageTextToText`) trains on pairs whose prompt carries images the same way
(recipes/configs/dpo/vlm_default.yaml: coloured shapes, a tiny Qwen2-VL): the chosen and rejected responses share
the prompt and its images, which the loader's workers decode once per pair.

    tunebook train --config_file accelerate_configs/cpu.yaml dpo                                # CPU
    tunebook train --config_file accelerate_configs/multi_cpu.yaml dpo                          # 2 CPU processes
    tunebook train --config_file accelerate_configs/single_gpu.yaml dpo \\
        --model_name_or_path outputs/my-sft-model --train_data prefs.jsonl                          # one GPU

The reference model is a frozen copy of the starting model, or with `use_peft` the policy with its adapters
switched off (no second model in memory), or with `precompute_ref_log_probs` log-probabilities computed once and
cached with the data. `loss_type` picks the loss (sigmoid, ipo, hinge, robust; simpo and orpo need no reference, and
none is built). Outputs in `output_dir` as for the other recipes: the model (or adapters), `config.yaml`,
`metrics.jsonl` (loss, rewards/chosen, rewards/rejected, rewards/accuracy, rewards/margin), `summary.json`,
`report.png` and `checkpoints/step-N/`.
"""

from __future__ import annotations

import torch

from tunebook import compat
from tunebook.config import DPOConfig, load_config
from tunebook.data import (
    PairCollator,
    VisionCollator,
    VisionPairCollator,
    fingerprint,
    format_loss_mask,
    train_and_eval_loaders,
)
from tunebook.distributed import prepare_then_join
from tunebook.evaluation import prompt_sampler
from tunebook.models import (
    apply_lora,
    build_chat_lm,
    describe_parameters,
    whole_weights,
)
from tunebook.preference import (
    REFERENCE_FREE_LOSSES,
    PreferenceData,
    RewardStats,
    evaluate_preferences,
    frozen_copy,
    partition_reference,
    policy_and_reference_log_probs,
    precompute_reference_log_probs,
    preference_loss,
    prepare_preference_or_vision_data,
    response_lengths,
    weights_fingerprint,
)
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
    sft_warmup,
    start_run,
    start_training,
    step_loss_scale,
)


def pair_collator(config: DPOConfig, data: PreferenceData):
    """One padded batch of chosen then rejected sequences a batch of pairs; with images, each pair's decoded once."""
    if data.processor is not None:
        return VisionPairCollator(data.processor, config.pad_to_multiple_of, config.max_image_pixels)
    return PairCollator(data.tokenizer.pad_token_id, config.pad_to_multiple_of)


def build_dataloaders(config: DPOConfig, data: PreferenceData):
    """Batches of pairs (`pair_collator`); workers collate in the background."""
    return train_and_eval_loaders(config, data.train, data.eval, pair_collator(config, data))


def evaluate(config: DPOConfig, model, reference, eval_loader, attn: str, dtype, accelerator) -> dict:
    return evaluate_preferences(
        model,
        reference,
        eval_loader,
        accelerator,
        attn,
        dtype,
        config.beta,
        config.label_smoothing,
        config.disable_tqdm,
        loss_type=config.loss_type,
        simpo_gamma=config.simpo_gamma,
        rpo_alpha=config.rpo_alpha,
    )


def warm_up(config: DPOConfig, model, data: PreferenceData, accelerator, log):
    """`sft_warmup_steps` of plain SFT on the chosen responses (with their images: decoded by their collator)."""
    vision = data.processor is not None
    chosen = data.train.select_columns(["chosen_input_ids", "chosen_labels", *(["images", "where"] if vision else [])])
    collate = VisionCollator(data.processor, config.pad_to_multiple_of, config.max_image_pixels) if vision else None
    sft_warmup(
        model,
        chosen.rename_columns({"chosen_input_ids": "input_ids", "chosen_labels": "labels"}),
        data.tokenizer.pad_token_id,
        steps=config.sft_warmup_steps,
        seed=config.seed,
        batch_size=config.per_device_train_batch_size,
        device=accelerator.device,
        log=log,
        pad_to_multiple_of=config.pad_to_multiple_of,
        collate_fn=collate,
    )


def precompute_reference(config: DPOConfig, model, data: PreferenceData, accelerator, cache_dir, attn: str, log):
    """The reference's log-probabilities of every pair, once, by the model as it is now: added to `data`'s splits and
    cached with the tokenised pairs."""
    model.to(accelerator.device)
    collate = pair_collator(config, data)
    reference_key = weights_fingerprint(model)
    for split in ("train", "eval"):
        if getattr(data, split) is not None:
            key = fingerprint({"pairs": data.keys[split], "reference": reference_key})
            # Under the lock of its cache entry: the first process computes, the others read its result.
            dataset, cached = precompute_reference_log_probs(
                model,
                getattr(data, split),
                collate,
                accelerator.device,
                cache_dir,
                key,
                config.per_device_eval_batch_size,
                attn,
            )
            setattr(data, split, dataset)
            log.info("Reference log-probabilities %s (%s)", "loaded from the cache" if cached else "computed", split)


def main(config: DPOConfig) -> dict:
    run = start_run(config, "dpo")  # Accelerator, logging, seed, output_dir locked
    accelerator, log = run.accelerator, run.log

    # --- data: prepared under a file lock (the first process builds, the others map the files), then all meet
    # A vision-language model's pairs carry images (its processor in data.processor), else text.
    data = prepare_then_join(accelerator, config, prepare_preference_or_vision_data, run.cache_dir, log)
    tokenizer, pair = data.tokenizer, data.train[0]
    log.info(
        "One training pair, loss-bearing text in [[...]]:\nchosen:   %s\nrejected: %s",
        format_loss_mask(tokenizer, pair["chosen_input_ids"], pair["chosen_labels"]),
        format_loss_mask(tokenizer, pair["rejected_input_ids"], pair["rejected_labels"]),
    )

    # --- model: the policy; optionally a brief SFT warm-up; then the reference it is measured against
    # a vision-language model (data.processor): its vision tower frozen (freeze_vision_tower)
    model = build_chat_lm(tokenizer, data.processor, config)
    with whole_weights(model):  # under DeepSpeed ZeRO-3 the model is built partitioned: whole until prepare
        if config.sft_warmup_steps:  # on the chosen responses
            warm_up(config, model, data, accelerator, log)
        attn, dtype = compat.attn_implementation(model.config), model.dtype
        reference = None  # with LoRA: the policy with its adapters off
        use_reference = config.loss_type not in REFERENCE_FREE_LOSSES
        if not use_reference:  # simpo, orpo: no copy, no adapters-off pass, nothing precomputed
            log.info("Loss %s uses no reference model: none built", config.loss_type)
        elif config.precompute_ref_log_probs:  # once, by the model as it is now, cached with the tokenised pairs
            precompute_reference(config, model, data, accelerator, run.cache_dir, attn, log)
        elif not config.use_peft:  # a frozen copy of the starting model
            reference = frozen_copy(model, accelerator.device)
    if config.use_peft:  # LoRA: the base stays frozen; checkpoints and the output hold only the adapters
        model = apply_lora(model, config)  # a VLM's all-linear: its language model's layers
    log.info("Model: %s, %s", type(model).__name__, describe_parameters(model))

    # --- optimizer, loaders
    optimizer = build_optimizer(
        model, config.learning_rate, config.weight_decay, (config.adam_beta1, config.adam_beta2), config.adam_epsilon
    )
    train_loader, eval_loader = build_dataloaders(config, data)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    reference = partition_reference(accelerator, reference)  # under ZeRO-3 sharded as the policy is
    plan = plan_steps(run, model, train_loader, "pairs")  # optimizer steps, in all and per epoch
    compiled = compile_model(config, accelerator, model, train_loader, plan.micro_batches, log)  # torch_compile
    schedule = build_scheduler(config.lr_scheduler_type, optimizer, plan.total_steps, config.warmup_ratio)
    lr_scheduler = accelerator.prepare(schedule)
    log.info("DPO loss %s, beta %g, label smoothing %g", config.loss_type, config.beta, config.label_smoothing)

    # --- resume (or start), then train: the loop's bookkeeping is tunebook.training.loop
    def run_evaluation() -> dict:
        return evaluate(config, model, reference, eval_loader, attn, dtype, accelerator)

    evaluation = run_evaluation if eval_loader is not None else None
    figures = RewardStats(accelerator.device)  # loss, rewards and reward accuracy: means over the window's pairs
    saved = load_checkpoint_or_start(run, optimizer, lr_scheduler, train_loader, figures, evaluation is not None)
    samples = prompt_sampler(config, model, tokenizer, accelerator)  # sample_prompts, at each evaluation
    loop = start_training(
        run, plan, saved, model, optimizer, lr_scheduler, train_loader, data, evaluation, compiled, samples
    )
    model.train()
    k = config.gradient_accumulation_steps
    for loader in epochs(run, loop):
        for window in accumulation_windows(loader, k, run.timer):
            # The loss is the mean over the pairs of the whole step (all micro-batches and processes).
            local_pairs = sum(torch.tensor(b["input_ids"].shape[0] // 2, device=accelerator.device) for b in window)
            scale = step_loss_scale(accelerator.reduce(local_pairs, "sum"), accelerator.num_processes, k)
            step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
            step_rewards = []
            for batch in window:
                with micro_batch(accelerator, model, last=batch is window[-1]):
                    # One forward of chosen + rejected (2B rows); the reference (if the loss has one) without gradients.
                    policy, ref = policy_and_reference_log_probs(
                        model, reference, batch, attn, dtype, accelerator, use_reference
                    )
                    losses, chosen_rewards, rejected_rewards = preference_loss(
                        policy,
                        ref,
                        response_lengths(batch["labels"]),
                        config.loss_type,
                        config.beta,
                        config.label_smoothing,
                        config.simpo_gamma,
                        config.rpo_alpha,
                    )
                    accelerator.backward(losses.sum() * scale)
                step_loss += losses.detach().sum().double()
                step_rewards.append((losses.detach(), chosen_rewards, rejected_rewards))
                loop.counters.add_batch(batch)  # tokens, padding and sequences (2 per pair), for the logs and summary
            # The step: clip, the finite check on every process, the update (or nan_policy's skip), the schedule.
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm or float("inf"))
            finite = finite_on_every_process(step_loss, grad_norm, accelerator)
            updated = optimizer_step_or_skip(run, loop.state, optimizer, finite)  # fp16: the scaler's step
            learning_rate = lr_scheduler.get_last_lr()[0]  # the rate this step trained at
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if updated:
                for rewards in step_rewards:
                    figures.add(*rewards)
            if after_step(run, loop, window, grad_norm, learning_rate):  # log, evaluate, save, stop
                break

    # --- final evaluation (the best checkpoint's weights with load_best_model_at_end) and outputs
    kind = "precomputed" if config.precompute_ref_log_probs else "adapters off" if config.use_peft else "copy"
    kind = kind if use_reference else "none"
    return finish(run, loop, headline=("eval_rewards/accuracy", "reward accuracy", ".3f"), reference=kind)


if __name__ == "__main__":
    main(load_config(DPOConfig))
