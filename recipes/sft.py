"""Supervised fine-tuning (SFT) of a causal language model on instruction or chat data.

With no arguments it runs the embedded offline default: it generates a synthetic digit task, trains a
tokenizer locally, builds a tiny Llama from a config, fine-tunes it and reports the exact match of its greedy
answers on a held-out split before and after training.

    tunebook train --config_file accelerate_configs/cpu.yaml sft                    # CPU
    tunebook train --config_file accelerate_configs/multi_cpu.yaml sft              # 2 CPU processes
    tunebook train --config_file accelerate_configs/single_gpu.yaml sft \\
        --config recipes/configs/sft/code_alpaca_smollm2.yaml                       # one GPU
    tunebook train --config_file accelerate_configs/multi_gpu.yaml sft --config ... # DDP

`tunebook train` is `accelerate launch recipes/sft.py` (the same options, before the recipe) that checks the config
first and ends a failed or stopped run with the recipe's own lines, not the launcher's traceback.

Any config key can be overridden: `--learning_rate 1e-4` or `--learning_rate=1e-4` (`--help` lists them).
Outputs in `output_dir`: the model and tokenizer (safetensors, `from_pretrained`-ready), `config.yaml`,
`metrics.jsonl`, `summary.json`, and `checkpoints/step-N/` when `save_steps` is set.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate.utils import set_seed

from tunebook.checkpoint import resume_training, save_final_model, save_training_state
from tunebook.config import load_config, save_config
from tunebook.data import (
    PackedCollator,
    PadCollator,
    SFTData,
    attention_inputs,
    build_loader,
    default_cache_dir,
    example_lengths,
    format_loss_mask,
    packing_mechanism,
    prepare_sft_data,
    use_packed_attention,
)
from tunebook.distributed import prepare_then_join
from tunebook.evaluation import evaluate_loss, generation_exact_match
from tunebook.logging import MetricsWriter, RunTimer, log_run_start, progress_bar, setup_logging, show_progress
from tunebook.models import TINY_LLAMA, apply_lora, build_causal_lm, describe_parameters, model_options
from tunebook.recipe_configs import SFTConfig
from tunebook.report import finish_run
from tunebook.summary import run_summary
from tunebook.trackers import start_trackers
from tunebook.training import (
    BestModel,
    StopSignals,
    Throughput,
    TrainCounters,
    accumulation_windows,
    build_optimizer,
    build_scheduler,
    causal_lm_token_losses,
    count_loss_tokens,
    eval_due,
    exit_code,
    is_nonfinite,
    nonfinite_stop,
    recipe_accelerator,
    save_due,
    step_loss_scale,
    total_optimizer_steps,
)


def build_dataloaders(config: SFTConfig, data: SFTData, num_processes: int):
    """Packed rows, or examples batched by similar length; workers collate in the background."""
    pad_id, multiple = data.tokenizer.pad_token_id, config.pad_to_multiple_of
    collate = PackedCollator(pad_id, multiple) if config.packing else PadCollator(pad_id, multiple)
    columns = ["input_ids", "labels", "seq_lengths"] if config.packing else ["input_ids", "labels"]
    common = {
        "collate_fn": collate,
        "seed": config.seed,
        "num_workers": config.dataloader_num_workers,
        "pin_memory": config.dataloader_pin_memory,
        "prefetch_factor": config.dataloader_prefetch_factor,
    }
    # Packed rows are all about max_seq_length long: grouping by length only matters for padded batches.
    lengths = example_lengths(data.train) if config.group_by_length and not config.packing else None
    global_batch = config.per_device_train_batch_size * num_processes * config.gradient_accumulation_steps
    train_loader = build_loader(
        data.train.select_columns(columns),
        config.per_device_train_batch_size,
        shuffle=True,
        lengths=lengths,
        group_size=global_batch,
        **common,
    )
    eval_loader = None
    if data.eval is not None:
        eval_loader = build_loader(
            data.eval.select_columns(columns), config.per_device_eval_batch_size, shuffle=False, **common
        )
    return train_loader, eval_loader


def evaluate(config: SFTConfig, model, data: SFTData, eval_loader, attn: str, accelerator, log) -> dict:
    metrics = evaluate_loss(model, eval_loader, accelerator, attn, disable_tqdm=config.disable_tqdm)
    if config.generation_eval:
        scores, samples = generation_exact_match(
            model,
            data.tokenizer,
            data.eval_examples,
            accelerator,
            batch_size=config.per_device_eval_batch_size,
            max_new_tokens=config.generation_max_new_tokens,
            max_samples=config.generation_eval_max_samples or None,
            disable_tqdm=config.disable_tqdm,
        )
        metrics.update(scores)
        for s in samples[:3]:
            log.info("  generated %r, reference %r", s["prediction"], s["reference"])
    return metrics


def main(config: SFTConfig) -> dict:
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
    data = prepare_then_join(accelerator, config, prepare_sft_data, cache_dir, log)
    tokenizer = data.tokenizer
    log.info(
        "Data ready in %.1f s (%s)", data.seconds, "built: " + ", ".join(data.built) if data.built else "all cached"
    )
    log.info(
        "One training %s, loss-bearing text in [[...]]:\n%s",
        "row" if config.packing else "example",
        format_loss_mask(tokenizer, data.train[0]["input_ids"], data.train[0]["labels"]),
    )

    # --- model, optimizer, loaders
    model = build_causal_lm(tokenizer, **model_options(config, TINY_LLAMA))
    if config.use_peft:  # LoRA: the base stays frozen; checkpoints and the output hold only the adapters
        model = apply_lora(model, config)
    log.info("Model: %s, %s", type(model).__name__, describe_parameters(model))
    attn, dtype = model.config._attn_implementation, model.dtype
    if config.packing:  # on a CPU, sdpa becomes our per-example (varlen) SDPA
        attn = use_packed_attention(model, accelerator.device)
        log.info("Packing with %s attention: %s", attn, packing_mechanism(attn))
    optimizer = build_optimizer(
        model, config.learning_rate, config.weight_decay, (config.adam_beta1, config.adam_beta2), config.adam_epsilon
    )
    train_loader, eval_loader = build_dataloaders(config, data, accelerator.num_processes)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    k = config.gradient_accumulation_steps
    total_steps, steps_per_epoch = total_optimizer_steps(
        config.max_steps, config.num_train_epochs, len(train_loader), k
    )
    lr_scheduler = accelerator.prepare(
        build_scheduler(config.lr_scheduler_type, optimizer, total_steps, config.warmup_ratio)
    )
    log.info(
        "Training %d optimizer steps (%d per epoch) of %d x %d micro-batches x %d process(es)",
        total_steps,
        steps_per_epoch,
        k,
        config.per_device_train_batch_size,
        accelerator.num_processes,
    )

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

    start_trackers(accelerator, config, "sft")  # tensorboard etc.: the config now, every metrics record below
    metrics_log = MetricsWriter(
        output_dir / "metrics.jsonl", accelerator.is_main_process, global_step if checkpoint else None, accelerator
    )
    eval_history = {}
    if eval_loader is not None and config.eval_on_start and checkpoint is None:
        eval_history[0] = evaluate(config, model, data, eval_loader, attn, accelerator, log)
        log.info("Before training: %s", eval_history[0])
        metrics_log.write({"step": 0, **eval_history[0]})

    # --- training loop
    final_train_loss = None
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
                # Normalise by the loss tokens of the whole step (all micro-batches and processes), not per micro-batch.
                local_tokens = sum(count_loss_tokens(b["labels"]) for b in window)
                scale = step_loss_scale(accelerator.reduce(local_tokens, "sum"), accelerator.num_processes, k)
                step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
                for batch in window:
                    with accelerator.accumulate(model):
                        # Logits only where a label is: prompt and padding positions carry no loss.
                        loss_sum = causal_lm_token_losses(model, attention_inputs(batch, attn, dtype), batch)[0].sum()
                        accelerator.backward(loss_sum * scale)
                    step_loss += loss_sum.detach().double()
                    counters.add_batch(batch)  # tokens, padding and examples, for the logs and the summary
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
                    counters.window_loss += step_loss
                    counters.window_tokens += local_tokens
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
                timer.step_done()
                progress.update(1)

                if global_step % config.logging_steps == 0 or global_step == total_steps:
                    final_train_loss = counters.pop_window_loss(accelerator)
                    record = {
                        "step": global_step,
                        "epoch": round(global_step / steps_per_epoch, 3),
                        "loss": final_train_loss,
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
                        eval_history[global_step] = evaluate(config, model, data, eval_loader, attn, accelerator, log)
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
        final_eval = evaluate(config, model, data, eval_loader, attn, accelerator, log)
        metrics_log.write({"step": global_step, **final_eval})
    if total_steps > 0:
        save_final_model(accelerator, model, tokenizer, output_dir, config.merge_adapter)
    summary = run_summary(
        "sft", config, accelerator, throughput, data, timer, counters, best,
        global_step=global_step,
        final_train_loss=final_train_loss,
        final_eval=final_eval,
        eval_before=eval_history.get(0, {}),
        skipped_updates=skipped_updates,
        resumed_from=checkpoint,
    )  # fmt: skip
    if accelerator.is_main_process:
        finish_run(output_dir, summary, log)  # summary.json, report.png, the table
        log.info("Model and tokenizer: %s", output_dir if total_steps > 0 else "(not saved: max_steps=0)")
        log.info("Summary: %s", output_dir / "summary.json")
        if "eval_exact_match" in final_eval:
            before = summary["eval_before_training"].get("eval_exact_match")
            log.info(
                "Eval exact match: %s before training -> %.3f after",
                "n/a" if before is None else f"{before:.3f}",
                final_eval["eval_exact_match"],
            )
    # Free the DDP model while the process group still exists: if the model outlives it, gloo's destructor runs
    # inside the model's and can deadlock on the GIL at exit (pytorch#56297).
    model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main(load_config(SFTConfig))
