"""Sequence classification: fine-tune an encoder (or any model with a sequence-classification head) on labelled text.

With no arguments it runs the embedded offline default: it generates a 4-topic classification task, trains a
WordPiece tokenizer locally, builds a tiny BERT from a config, fine-tunes it and reports accuracy and F1 on the
held-out split before and after training.

    tunebook train --config_file accelerate_configs/cpu.yaml classify                           # CPU
    tunebook train --config_file accelerate_configs/multi_cpu.yaml classify                     # 2 CPU processes
    tunebook train --config_file accelerate_configs/single_gpu.yaml classify \\
        --model_name_or_path path/to/encoder --train_data train.jsonl --eval_data dev.jsonl      # one GPU

Any config key can be overridden: `--learning_rate 1e-4` (`--help` lists them). Outputs in `output_dir`: the
model (its config names the labels, so `pipeline("text-classification", model=output_dir)` prints them) and
tokenizer, `config.yaml`, `metrics.jsonl`, `summary.json`, and `checkpoints/step-N/` when checkpoints are saved.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from transformers import DataCollatorWithPadding

from tunebook.checkpoint import resume_training, save_final_model, save_training_state
from tunebook.config import load_config, save_config
from tunebook.data import ClassificationData, build_loader, default_cache_dir, prepare_classification_data
from tunebook.distributed import prepare_then_join
from tunebook.evaluation import classifier_inputs, evaluate_classifier
from tunebook.logging import MetricsWriter, RunTimer, log_run_start, progress_bar, setup_logging, show_progress
from tunebook.models import TINY_BERT, apply_lora, build_sequence_classifier, describe_parameters, model_options
from tunebook.recipe_configs import ClassifyConfig
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
    eval_due,
    exit_code,
    is_nonfinite,
    nonfinite_stop,
    recipe_accelerator,
    save_due,
    step_loss_scale,
    total_optimizer_steps,
)


def build_dataloaders(config: ClassifyConfig, data: ClassificationData):
    """Tokenised examples padded per batch to the longest one; workers collate in the background."""
    collate = DataCollatorWithPadding(data.tokenizer, pad_to_multiple_of=config.pad_to_multiple_of)
    common = {
        "collate_fn": collate,
        "seed": config.seed,
        "num_workers": config.dataloader_num_workers,
        "pin_memory": config.dataloader_pin_memory,
        "prefetch_factor": config.dataloader_prefetch_factor,
    }
    train_loader = build_loader(data.train, config.per_device_train_batch_size, shuffle=True, **common)
    eval_loader = None
    if data.eval is not None:
        eval_loader = build_loader(data.eval, config.per_device_eval_batch_size, shuffle=False, **common)
    return train_loader, eval_loader


def evaluate(config: ClassifyConfig, model, data: ClassificationData, eval_loader, accelerator) -> dict:
    average = config.metric_average or ("binary" if len(data.label_names) == 2 else "macro")
    return evaluate_classifier(model, eval_loader, accelerator, config.metrics, average, config.disable_tqdm)


def main(config: ClassifyConfig) -> dict:
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
    data = prepare_then_join(accelerator, config, prepare_classification_data, cache_dir, log)
    tokenizer = data.tokenizer
    log.info("Data ready in %.1f s (%s); labels %s", data.seconds,
             "built: " + ", ".join(data.built) if data.built else "all cached", data.stats["label_counts"])  # fmt: skip
    example = data.train[0]  # what the model sees, and the label it learns to predict (the loss) in [[...]]
    log.info("One training example: %s -> [[%s]]", tokenizer.decode(example["input_ids"]),
             data.label_names[example["labels"]])  # fmt: skip

    # --- model, optimizer, loaders
    model = build_sequence_classifier(tokenizer, data.label_names, **model_options(config, TINY_BERT))
    if config.use_peft:  # LoRA: the base stays frozen; checkpoints and the output hold only the adapters
        model = apply_lora(model, config, "classification")
    log.info("Model: %s, %s", type(model).__name__, describe_parameters(model))
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
    log.info("Training %d optimizer steps (%d per epoch) of %d x %d micro-batches x %d process(es)", total_steps,
             steps_per_epoch, k, config.per_device_train_batch_size, accelerator.num_processes)  # fmt: skip

    # --- resume: model, optimizer, scheduler, RNG states and the data position, from a checkpoint
    counters = TrainCounters.zeros(accelerator.device)  # window_tokens counts examples here
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

    start_trackers(accelerator, config, "classify")  # tensorboard etc.: the config now, every metrics record below
    metrics_log = MetricsWriter(
        output_dir / "metrics.jsonl", accelerator.is_main_process, global_step if checkpoint else None, accelerator
    )
    eval_history = {}
    if eval_loader is not None and config.eval_on_start and checkpoint is None:
        eval_history[0] = evaluate(config, model, data, eval_loader, accelerator)
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
                # Mean over the examples of the whole step (all micro-batches and processes), not per micro-batch.
                local_examples = sum(torch.tensor(len(b["labels"]), device=accelerator.device) for b in window)
                scale = step_loss_scale(accelerator.reduce(local_examples, "sum"), accelerator.num_processes, k)
                step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
                for batch in window:
                    with accelerator.accumulate(model):
                        logits = model(**classifier_inputs(batch)).logits
                        loss_sum = F.cross_entropy(logits.float(), batch["labels"], reduction="sum")
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
                    counters.window_tokens += local_examples
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
                        eval_history[global_step] = evaluate(config, model, data, eval_loader, accelerator)
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
        final_eval = evaluate(config, model, data, eval_loader, accelerator)
        metrics_log.write({"step": global_step, **final_eval})
    if total_steps > 0:
        save_final_model(accelerator, model, tokenizer, output_dir, config.merge_adapter)
    summary = run_summary(
        "classify", config, accelerator, throughput, data, timer, counters, best,
        global_step=global_step,
        final_train_loss=final_train_loss,
        final_eval=final_eval,
        eval_before=eval_history.get(0, {}),
        skipped_updates=skipped_updates,
        resumed_from=checkpoint,
        labels=data.label_names,
    )  # fmt: skip
    if accelerator.is_main_process:
        finish_run(output_dir, summary, log)  # summary.json, report.png, the table
        log.info("Model and tokenizer: %s", output_dir if total_steps > 0 else "(not saved: max_steps=0)")
        log.info("Summary: %s", output_dir / "summary.json")
        before = summary["eval_before_training"].get("eval_accuracy")
        if "eval_accuracy" in final_eval:
            log.info("Eval accuracy: %s before training -> %.3f after",
                     "n/a" if before is None else f"{before:.3f}", final_eval["eval_accuracy"])  # fmt: skip
    # Free the DDP model while the process group still exists: if the model outlives it, gloo's destructor runs
    # inside the model's and can deadlock on the GIL at exit (pytorch#56297).
    model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main(load_config(ClassifyConfig))
