"""Direct Preference Optimization (DPO) of a causal language model on (prompt, chosen, rejected) pairs.

With no arguments it runs the embedded offline default: it generates preference pairs over the SFT default's digit
task (the right answer chosen, a near miss rejected), trains a tokenizer locally, builds a tiny Llama, teaches it
the task format with a brief SFT warm-up on the chosen answers, then runs DPO against a frozen copy of that model
and reports the reward accuracy on held-out pairs before and after.

    tunebook train --config_file accelerate_configs/cpu.yaml dpo                                # CPU
    tunebook train --config_file accelerate_configs/multi_cpu.yaml dpo                          # 2 CPU processes
    tunebook train --config_file accelerate_configs/single_gpu.yaml dpo \\
        --model_name_or_path outputs/my-sft-model --train_data prefs.jsonl                          # one GPU

The reference model is a frozen copy of the starting model, or with `use_peft` the policy with its adapters
switched off (no second model in memory), or with `precompute_ref_log_probs` log-probabilities computed once and
cached with the data. Outputs in `output_dir` as for the other recipes: the model (or adapters), `config.yaml`,
`metrics.jsonl` (loss, rewards/chosen, rewards/rejected, rewards/accuracy, rewards/margin), `summary.json`,
`report.png` and `checkpoints/step-N/`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from accelerate.utils import set_seed

from tunebook.checkpoint import resume_training, save_final_model, save_training_state
from tunebook.config import load_config, save_config
from tunebook.data import (
    PadCollator,
    PairCollator,
    PreferenceData,
    build_loader,
    default_cache_dir,
    fingerprint,
    format_loss_mask,
    prepare_preference_data,
)
from tunebook.distributed import preparation_lock, prepare_then_join
from tunebook.evaluation import evaluate_preferences
from tunebook.logging import MetricsWriter, RunTimer, log_run_start, progress_bar, setup_logging, show_progress
from tunebook.models import TINY_LLAMA, apply_lora, build_causal_lm, describe_parameters, model_options
from tunebook.recipe_configs import DPOConfig
from tunebook.report import finish_run
from tunebook.summary import run_summary
from tunebook.trackers import start_trackers
from tunebook.training import (
    BestModel,
    RewardStats,
    StopSignals,
    Throughput,
    TrainCounters,
    accumulation_windows,
    build_optimizer,
    build_scheduler,
    causal_lm_token_losses,
    dpo_loss,
    eval_due,
    exit_code,
    is_nonfinite,
    nonfinite_stop,
    policy_and_reference_log_probs,
    precompute_reference_log_probs,
    recipe_accelerator,
    save_due,
    step_loss_scale,
    total_optimizer_steps,
    weights_fingerprint,
)


def build_dataloaders(config: DPOConfig, data: PreferenceData):
    collate = PairCollator(data.tokenizer.pad_token_id, config.pad_to_multiple_of)
    common = {"collate_fn": collate, "seed": config.seed, "num_workers": config.dataloader_num_workers,
              "pin_memory": config.dataloader_pin_memory, "prefetch_factor": config.dataloader_prefetch_factor}  # fmt: skip
    train_loader = build_loader(data.train, config.per_device_train_batch_size, shuffle=True, **common)
    eval_loader = None
    if data.eval is not None:
        eval_loader = build_loader(data.eval, config.per_device_eval_batch_size, shuffle=False, **common)
    return train_loader, eval_loader


def sft_warmup(config: DPOConfig, model, data: PreferenceData, device, log) -> None:
    """Plain SFT on the chosen responses, before DPO and before `prepare`: every process runs the same steps on the
    same data from the same seed, and DDP then starts all replicas from rank 0's weights."""
    chosen = data.train.select_columns(["chosen_input_ids", "chosen_labels"])
    chosen = chosen.rename_columns({"chosen_input_ids": "input_ids", "chosen_labels": "labels"})
    loader = build_loader(chosen, config.per_device_train_batch_size, shuffle=True, seed=config.seed, num_workers=0,
                          collate_fn=PadCollator(data.tokenizer.pad_token_id, config.pad_to_multiple_of))  # fmt: skip
    optimizer = build_optimizer(model, 3e-3, 0.0, (0.9, 0.999), 1e-8)
    model.to(device).train()
    step = 0
    while step < config.warmup_steps:
        for batch in loader:  # a new order each epoch, from the loader's own seeded generator
            batch = {k: v.to(device) for k, v in batch.items()}
            losses = causal_lm_token_losses(model, {"input_ids": batch["input_ids"],
                                                    "attention_mask": batch["attention_mask"]}, batch)[0]  # fmt: skip
            losses.mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0 or step == config.warmup_steps:
                log.info("SFT warm-up step %d/%d: loss %.4f", step, config.warmup_steps, losses.mean().item())
            if step == config.warmup_steps:
                break


def evaluate(config: DPOConfig, model, reference, eval_loader, attn: str, dtype, accelerator) -> dict:
    return evaluate_preferences(model, reference, eval_loader, accelerator, attn, dtype, config.beta,
                                config.label_smoothing, config.disable_tqdm)  # fmt: skip


def main(config: DPOConfig) -> dict:
    timer = RunTimer()
    accelerator = recipe_accelerator(config)  # engine, trackers, timeouts from the config and the launcher
    log = setup_logging(accelerator.is_main_process, config.log_level, config.disable_tqdm)
    set_seed(config.seed)
    output_dir = Path(config.output_dir)
    cache_dir = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
    if accelerator.is_main_process:
        save_config(config, output_dir / "config.yaml")
    log_run_start(log, config, accelerator)  # the resolved config, key aliases used, processes

    # --- data: prepared under a file lock (the first process builds, the others map the files), then all meet
    data = prepare_then_join(accelerator, config, prepare_preference_data, cache_dir, log)
    tokenizer = data.tokenizer
    log.info(
        "Data ready in %.1f s (%s)", data.seconds, "built: " + ", ".join(data.built) if data.built else "all cached"
    )
    pair = data.train[0]
    log.info("One training pair, loss-bearing text in [[...]]:\nchosen:   %s\nrejected: %s",
             format_loss_mask(tokenizer, pair["chosen_input_ids"], pair["chosen_labels"]),
             format_loss_mask(tokenizer, pair["rejected_input_ids"], pair["rejected_labels"]))  # fmt: skip

    # --- model: the policy; optionally a brief SFT warm-up; then the reference it is measured against
    model = build_causal_lm(tokenizer, **model_options(config, TINY_LLAMA))
    if config.warmup_steps:
        sft_warmup(config, model, data, accelerator.device, log)
    attn, dtype = model.config._attn_implementation, model.dtype
    reference = None  # with LoRA: the policy with its adapters off
    if config.precompute_ref_log_probs:  # once, by the model as it is now, cached with the tokenised pairs
        model.to(accelerator.device)
        collate = PairCollator(tokenizer.pad_token_id, config.pad_to_multiple_of)
        reference_key = weights_fingerprint(model)
        for split in ("train", "eval"):
            if getattr(data, split) is not None:
                key = fingerprint({"pairs": data.keys[split], "reference": reference_key})
                with preparation_lock(cache_dir):  # the first process computes, the others read its result
                    dataset, cached = precompute_reference_log_probs(model, getattr(data, split), collate,
                        accelerator.device, cache_dir, key, config.per_device_eval_batch_size, attn)  # fmt: skip
                setattr(data, split, dataset)
                log.info(
                    "Reference log-probabilities %s (%s)", "loaded from the cache" if cached else "computed", split
                )
    elif not config.use_peft:  # a frozen copy of the starting model
        reference = copy.deepcopy(model).requires_grad_(False).eval().to(accelerator.device)
    if config.use_peft:  # LoRA: the base stays frozen; checkpoints and the output hold only the adapters
        model = apply_lora(model, config)
    log.info("Model: %s, %s", type(model).__name__, describe_parameters(model))

    # --- optimizer, loaders
    optimizer = build_optimizer(
        model, config.learning_rate, config.weight_decay, (config.adam_beta1, config.adam_beta2), config.adam_epsilon
    )
    train_loader, eval_loader = build_dataloaders(config, data)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    k = config.gradient_accumulation_steps
    total_steps, steps_per_epoch = total_optimizer_steps(
        config.max_steps, config.num_train_epochs, len(train_loader), k
    )
    lr_scheduler = accelerator.prepare(
        build_scheduler(config.lr_scheduler_type, optimizer, total_steps, config.warmup_ratio)
    )
    log.info("Training %d optimizer steps (%d per epoch) of %d x %d pairs x %d process(es), beta %g",
             total_steps, steps_per_epoch, k, config.per_device_train_batch_size, accelerator.num_processes,
             config.beta)  # fmt: skip

    # --- resume: model, optimizer, scheduler, RNG states and the data position, from a checkpoint
    counters = TrainCounters.zeros(accelerator.device)
    best = BestModel.from_config(config) if eval_loader is not None else None  # best checkpoint, early stopping
    checkpoint, state = resume_training(accelerator, output_dir, config.resume_from_checkpoint, counters, best)
    if checkpoint is not None:
        log.info("Resumed from %s: step %d, epoch %d, %d batches into it", checkpoint, state["global_step"],
                 state["epoch"], state["batches_in_epoch"])  # fmt: skip
    global_step, epoch, skip_batches = state["global_step"], state["epoch"], state["batches_in_epoch"]
    skipped_updates = state.get("skipped_updates", 0)

    def save(reason: str):
        with timer.paused():
            shared = {"epoch": epoch, "batches_in_epoch": batches_in_epoch, "skipped_updates": skipped_updates}
            path = save_training_state(accelerator, output_dir, global_step, config, shared, tokenizer, counters, best)
        log.info("Saved checkpoint %s (%s)", path, reason)

    start_trackers(accelerator, config, "dpo")  # tensorboard etc.: the config now, every metrics record below
    metrics_log = MetricsWriter(
        output_dir / "metrics.jsonl", accelerator.is_main_process, global_step if checkpoint else None, accelerator
    )
    eval_history = {}
    if eval_loader is not None and config.eval_on_start and checkpoint is None:
        eval_history[0] = evaluate(config, model, reference, eval_loader, attn, dtype, accelerator)
        log.info("Before training: %s", eval_history[0])
        metrics_log.write({"step": 0, **eval_history[0]})

    # --- training loop
    final_train_loss = None
    rewards = RewardStats(accelerator.device)  # loss, rewards and reward accuracy of each logging window
    progress = progress_bar(accelerator.is_main_process, config.disable_tqdm, total=total_steps, initial=global_step,
                            desc="Training")  # fmt: skip
    throughput = Throughput(accelerator, model, data.train, timer, counters, config.peak_flops)  # per-log figures
    model.train()
    timer.start_training()
    stop = None  # the exception that ends the run early, raised once the model and process group are released
    with StopSignals() as stop_signals:
        while global_step < total_steps and stop is None and not (best and best.should_stop()):
            train_loader.set_epoch(epoch)
            # On resume, skip the batches the checkpoint had consumed, at the sampler: nothing is re-read.
            loader = accelerator.skip_first_batches(train_loader, skip_batches) if skip_batches else train_loader
            loader.set_epoch(epoch)
            batches_in_epoch, skip_batches = skip_batches, 0
            for window in accumulation_windows(loader, k, timer):
                # The loss is the mean over the pairs of the whole step (all micro-batches and processes).
                local_pairs = sum(
                    torch.tensor(b["input_ids"].shape[0] // 2, device=accelerator.device) for b in window
                )
                scale = step_loss_scale(accelerator.reduce(local_pairs, "sum"), accelerator.num_processes, k)
                step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
                for batch in window:
                    with accelerator.accumulate(model):
                        # One forward of chosen + rejected (2B rows); the reference without gradients.
                        policy, ref = policy_and_reference_log_probs(model, reference, batch, attn, dtype, accelerator)
                        half = policy.shape[0] // 2
                        losses, chosen_rewards, rejected_rewards = dpo_loss(
                            policy[:half], policy[half:], ref[:half], ref[half:], config.beta, config.label_smoothing
                        )
                        accelerator.backward(losses.sum() * scale)
                    step_loss += losses.detach().sum().double()
                    rewards.add(losses, chosen_rewards, rejected_rewards)
                    counters.add_batch(batch)  # tokens, padding and sequences (2 per pair), for the logs and summary
                batches_in_epoch += len(window)
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm or float("inf"))
                if is_nonfinite(step_loss, grad_norm, accelerator):
                    if config.nan_policy == "stop":
                        stop = nonfinite_stop(global_step, output_dir)
                        break
                    skipped_updates += 1
                    log.warning("Step %d: non-finite loss or gradient norm, update skipped (%d so far)",
                                global_step + 1, skipped_updates)  # fmt: skip
                else:
                    optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
                timer.step_done()
                progress.update(1)

                if global_step % config.logging_steps == 0 or global_step == total_steps:
                    window_stats = rewards.pop(accelerator)  # loss and rewards: means over the window's pairs
                    final_train_loss = window_stats["loss"]
                    record = {
                        "step": global_step,
                        "epoch": round(global_step / steps_per_epoch, 3),
                        **window_stats,
                        "learning_rate": lr_scheduler.get_last_lr()[0],
                        "grad_norm": float(grad_norm),
                        **throughput.window(),  # tokens/s, samples/s, data wait, MFU, peak memory: all processes
                    }
                    metrics_log.write(record)
                    show_progress(progress, record, total_steps, log)
                epoch_done = batches_in_epoch == len(train_loader)
                new_best = False
                if eval_loader is not None and eval_due(config, global_step, total_steps, epoch_done):
                    with timer.paused():
                        eval_history[global_step] = evaluate(config, model, reference, eval_loader, attn, dtype,
                                                             accelerator)  # fmt: skip
                    log.info("Step %d: %s", global_step, eval_history[global_step])
                    metrics_log.write({"step": global_step, **eval_history[global_step]})
                    new_best = best is not None and best.update(global_step, eval_history[global_step])
                signum = stop_signals.requested(accelerator)
                if signum:  # preemption or Ctrl-C: finish this step, save, and leave
                    save(f"stopped by signal {signum}")
                    log.warning("Stopped at step %d by signal %d. Resume with the same command plus "
                                "--resume_from_checkpoint latest", global_step, signum)  # fmt: skip
                    stop = SystemExit(exit_code(signum))
                    break
                if reason := save_due(config, global_step, epoch_done, new_best):
                    save(reason)
                if best is not None and best.should_stop():
                    log.info("Early stopping at step %d: %s has not improved on %.6g (step %d) for %d evaluations",
                             global_step, best.metric, best.best_value, best.best_step, best.patience)  # fmt: skip
                    break
                if global_step >= total_steps:
                    break
            epoch += 1
    progress.close()
    if stop is not None:
        model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)
        accelerator.end_training()
        raise stop

    # --- final evaluation and outputs (of the best checkpoint's weights with load_best_model_at_end)
    if config.load_best_model_at_end and best is not None and best.best_checkpoint:
        accelerator.load_state(best.best_checkpoint)
        log.info("Loaded the best checkpoint %s (%s %.6g)", best.best_checkpoint, best.metric, best.best_value)
    final_eval = {}
    if eval_loader is not None:
        final_eval = evaluate(config, model, reference, eval_loader, attn, dtype, accelerator)
        metrics_log.write({"step": global_step, **final_eval})
    if total_steps > 0:
        save_final_model(accelerator, model, tokenizer, output_dir, config.merge_adapter)
    summary = run_summary(
        "dpo", config, accelerator, throughput, data, timer, counters, best,
        global_step=global_step,
        final_train_loss=final_train_loss,
        final_eval=final_eval,
        eval_before=eval_history.get(0, {}),
        skipped_updates=skipped_updates,
        resumed_from=checkpoint,
        reference="precomputed" if config.precompute_ref_log_probs else "adapters off" if config.use_peft else "copy",
    )  # fmt: skip
    if accelerator.is_main_process:
        finish_run(output_dir, summary, log)  # summary.json, report.png, the table
        log.info("Model and tokenizer: %s", output_dir if total_steps > 0 else "(not saved: max_steps=0)")
        if "eval_rewards/accuracy" in final_eval:
            before = summary["eval_before_training"].get("eval_rewards/accuracy")
            log.info("Eval reward accuracy: %s before training -> %.3f after",
                     "n/a" if before is None else f"{before:.3f}", final_eval["eval_rewards/accuracy"])  # fmt: skip
    # Free the DDP model while the process group still exists (pytorch#56297, see recipes/sft.py).
    model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main(load_config(DPOConfig))
