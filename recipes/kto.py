"""Kahneman-Tversky Optimization (KTO) of a causal language model on completions labelled desirable or undesirable.

With no arguments it runs the embedded offline default: it generates the DPO default's digit-task preference pairs
and splits each into a desirable row (the right answer) and an undesirable one (a near miss), trains a tokenizer
locally, builds a tiny Llama, teaches it the task format with a brief SFT warm-up on the desirable completions, then
runs KTO against a frozen copy of that model and reports the reward margin between desirable and undesirable
held-out completions before and after.

    tunebook train --config_file accelerate_configs/cpu.yaml kto                                # CPU
    tunebook train --config_file accelerate_configs/multi_cpu.yaml kto                          # 2 CPU processes
    tunebook train --config_file accelerate_configs/single_gpu.yaml kto \\
        --model_name_or_path outputs/my-sft-model --train_data feedback.jsonl                       # one GPU

Data: TRL's unpaired rows (`prompt`, `completion`, `label` true/false) or preference pairs (`prompt`, `chosen`,
`rejected`), split into rows. Each row carries a mismatched KL row (its prompt, another row's completion), fixed at
data preparation; each step's KL reference point is the mean log-ratio of all its KL rows, over every micro-batch and
process, clamped at 0 (`tunebook.preference.kto`: where and why this differs from TRL). The reference model is a
frozen copy of the starting model, or with `use_peft` the policy with its adapters switched off, or with
`precompute_ref_log_probs` log-probabilities computed once and cached with the data. Outputs in `output_dir` as for
the other recipes: the model (or adapters), `config.yaml`, `metrics.jsonl` (loss, rewards/chosen, rewards/rejected,
rewards/margin, kl), `summary.json`, `report.png` and `checkpoints/step-N/`.
"""

from __future__ import annotations

import torch

from tunebook import compat
from tunebook.config import KTOConfig, load_config
from tunebook.data import fingerprint, format_loss_mask, train_and_eval_loaders
from tunebook.distributed import prepare_then_join
from tunebook.evaluation import prompt_sampler
from tunebook.models import apply_lora, build_chat_lm, describe_parameters, whole_weights
from tunebook.preference import (
    KTOCollator,
    KTOData,
    KTOStats,
    evaluate_kto,
    frozen_copy,
    kto_loss,
    partition_reference,
    precompute_kto_reference,
    prepare_kto_data,
    sequence_log_probs,
    step_kl_and_reference,
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


def build_dataloaders(config: KTOConfig, data: KTOData):
    """Batches of rows, each with its KL row (`KTOCollator`); workers collate in the background."""
    collate = KTOCollator(data.tokenizer.pad_token_id, config.pad_to_multiple_of)
    return train_and_eval_loaders(config, data.train, data.eval, collate)


def evaluate(config: KTOConfig, model, reference, eval_loader, attn: str, dtype, accelerator) -> dict:
    return evaluate_kto(
        model,
        reference,
        eval_loader,
        accelerator,
        attn,
        dtype,
        config.beta,
        config.desirable_weight,
        config.undesirable_weight,
        config.disable_tqdm,
    )


def warm_up(config: KTOConfig, model, data: KTOData, accelerator, log):
    """`sft_warmup_steps` of plain SFT on the desirable completions."""
    desirable = data.train.filter(lambda label: label, input_columns="label")
    sft_warmup(
        model,
        desirable.select_columns(["input_ids", "labels"]),
        data.tokenizer.pad_token_id,
        steps=config.sft_warmup_steps,
        seed=config.seed,
        batch_size=config.per_device_train_batch_size,
        device=accelerator.device,
        log=log,
        pad_to_multiple_of=config.pad_to_multiple_of,
    )


def precompute_reference(config: KTOConfig, model, data: KTOData, accelerator, cache_dir, attn: str, log):
    """The reference's log-probabilities of every row and KL row, once, by the model as it is now: added to `data`'s
    splits and cached with the tokenised rows."""
    model.to(accelerator.device)
    reference_key = weights_fingerprint(model)
    for split in ("train", "eval"):
        if getattr(data, split) is not None:
            key = fingerprint({"rows": data.keys[split], "reference": reference_key})
            # Under the lock of its cache entry: the first process computes, the others read its result.
            dataset, cached = precompute_kto_reference(
                model,
                getattr(data, split),
                data.tokenizer.pad_token_id,
                accelerator.device,
                cache_dir,
                key,
                config.per_device_eval_batch_size,
                attn,
            )
            setattr(data, split, dataset)
            log.info("Reference log-probabilities %s (%s)", "loaded from the cache" if cached else "computed", split)


def main(config: KTOConfig) -> dict:
    run = start_run(config, "kto")  # Accelerator, logging, seed, output_dir locked
    accelerator, log = run.accelerator, run.log

    # --- data: prepared under a file lock (the first process builds, the others map the files), then all meet
    data = prepare_then_join(accelerator, config, prepare_kto_data, run.cache_dir, log)
    tokenizer, row = data.tokenizer, data.train[0]
    log.info(
        "One training row (%s), loss-bearing text in [[...]]:\n%s\nits KL row: %s",
        "desirable" if row["label"] else "undesirable",
        format_loss_mask(tokenizer, row["input_ids"], row["labels"]),
        format_loss_mask(tokenizer, row["kl_input_ids"], row["kl_labels"]),
    )

    # --- model: the policy; optionally a brief SFT warm-up; then the reference it is measured against
    model = build_chat_lm(tokenizer, None, config)
    with whole_weights(model):  # under DeepSpeed ZeRO-3 the model is built partitioned: whole until prepare
        if config.sft_warmup_steps:  # on the desirable completions
            warm_up(config, model, data, accelerator, log)
        attn, dtype = compat.attn_implementation(model.config), model.dtype
        reference = None  # with LoRA: the policy with its adapters off
        if config.precompute_ref_log_probs:  # once, by the model as it is now, cached with the tokenised rows
            precompute_reference(config, model, data, accelerator, run.cache_dir, attn, log)
        elif not config.use_peft:  # a frozen copy of the starting model
            reference = frozen_copy(model, accelerator.device)
    if config.use_peft:  # LoRA: the base stays frozen; checkpoints and the output hold only the adapters
        model = apply_lora(model, config)
    log.info("Model: %s, %s", type(model).__name__, describe_parameters(model))

    # --- optimizer, loaders
    optimizer = build_optimizer(
        model, config.learning_rate, config.weight_decay, (config.adam_beta1, config.adam_beta2), config.adam_epsilon
    )
    train_loader, eval_loader = build_dataloaders(config, data)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    reference = partition_reference(accelerator, reference)  # under ZeRO-3 sharded as the policy is
    plan = plan_steps(run, model, train_loader, "rows")  # optimizer steps, in all and per epoch
    compiled = compile_model(config, accelerator, model, train_loader, plan.micro_batches, log)  # torch_compile
    schedule = build_scheduler(config.lr_scheduler_type, optimizer, plan.total_steps, config.warmup_ratio)
    lr_scheduler = accelerator.prepare(schedule)
    log.info(
        "KTO: beta %g, desirable_weight %g, undesirable_weight %g",
        config.beta,
        config.desirable_weight,
        config.undesirable_weight,
    )

    # --- resume (or start), then train: the loop's bookkeeping is tunebook.training.loop
    def run_evaluation() -> dict:
        return evaluate(config, model, reference, eval_loader, attn, dtype, accelerator)

    evaluation = run_evaluation if eval_loader is not None else None
    figures = KTOStats(accelerator.device)  # loss, rewards by label, KL: means over the window's rows and steps
    saved = load_checkpoint_or_start(run, optimizer, lr_scheduler, train_loader, figures, evaluation is not None)
    samples = prompt_sampler(config, model, tokenizer, accelerator)  # sample_prompts, at each evaluation
    loop = start_training(
        run, plan, saved, model, optimizer, lr_scheduler, train_loader, data, evaluation, compiled, samples
    )
    model.train()
    k = config.gradient_accumulation_steps
    for loader in epochs(run, loop):
        for window in accumulation_windows(loader, k, run.timer):
            # The loss is the mean over the rows of the whole step (all micro-batches and processes).
            local_rows = sum(torch.tensor(b["input_ids"].shape[0], device=accelerator.device) for b in window)
            scale = step_loss_scale(accelerator.reduce(local_rows, "sum"), accelerator.num_processes, k)
            # The step's KL reference point first, without gradients, from every KL row of the step; the reference's
            # log-probabilities of the rows come from the same pass.
            kl, references = step_kl_and_reference(model, reference, window, attn, dtype, accelerator)
            step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
            step_rewards = []
            for batch, ref in zip(window, references):
                with micro_batch(accelerator, model, last=batch is window[-1]):
                    policy = sequence_log_probs(model, batch, attn, dtype)
                    losses, rewards = kto_loss(
                        policy,
                        ref,
                        batch["label"],
                        kl,
                        config.beta,
                        config.desirable_weight,
                        config.undesirable_weight,
                    )
                    accelerator.backward(losses.sum() * scale)
                step_loss += losses.detach().sum().double()
                step_rewards.append((losses.detach(), rewards, batch["label"]))
                loop.counters.add_batch(batch)  # tokens, padding and rows, for the logs and summary
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
                figures.add_kl(kl)
            if after_step(run, loop, window, grad_norm, learning_rate):  # log, evaluate, save, stop
                break

    # --- final evaluation (the best checkpoint's weights with load_best_model_at_end) and outputs
    kind = "precomputed" if config.precompute_ref_log_probs else "adapters off" if config.use_peft else "copy"
    return finish(run, loop, headline=("eval_rewards/margin", "reward margin", ".3f"), reference=kind)


if __name__ == "__main__":
    main(load_config(KTOConfig))
