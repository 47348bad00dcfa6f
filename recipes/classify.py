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

import torch
import torch.nn.functional as F
from transformers import DataCollatorWithPadding

from tunebook.config import ClassifyConfig, load_config
from tunebook.data import ClassificationData, prepare_classification_data, train_and_eval_loaders
from tunebook.distributed import prepare_then_join
from tunebook.evaluation import classifier_inputs, evaluate_classifier
from tunebook.models import apply_lora, build_sequence_classifier, describe_parameters, model_options
from tunebook.training import (
    LossWindow,
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


def build_dataloaders(config: ClassifyConfig, data: ClassificationData):
    """Tokenised examples padded per batch to the longest one; workers collate in the background."""
    collate = DataCollatorWithPadding(data.tokenizer, pad_to_multiple_of=config.pad_to_multiple_of)
    return train_and_eval_loaders(config, data.train, data.eval, collate)


def evaluate(config: ClassifyConfig, model, data: ClassificationData, eval_loader, accelerator) -> dict:
    average = config.metric_average or ("binary" if len(data.label_names) == 2 else "macro")
    return evaluate_classifier(model, eval_loader, accelerator, config.metrics, average, config.disable_tqdm)


def main(config: ClassifyConfig) -> dict:
    run = start_run(config, "classify")  # Accelerator, logging, seed, output_dir locked
    accelerator, log = run.accelerator, run.log

    # --- data: prepared under a file lock (the first process builds, the others map the files), then all meet
    data = prepare_then_join(accelerator, config, prepare_classification_data, run.cache_dir, log)
    tokenizer = data.tokenizer
    log.info("Labels: %s", data.stats["label_counts"])
    example = data.train[0]  # what the model sees, and the label it learns to predict (the loss) in [[...]]
    log.info(
        "One training example: %s -> [[%s]]",
        tokenizer.decode(example["input_ids"]),
        data.label_names[example["labels"]],
    )

    # --- model, optimizer, loaders
    model = build_sequence_classifier(tokenizer, data.label_names, model_options(config))
    if config.use_peft:  # LoRA: the base stays frozen; checkpoints and the output hold only the adapters
        model = apply_lora(model, config, "classification")
    log.info("Model: %s, %s", type(model).__name__, describe_parameters(model))
    optimizer = build_optimizer(
        model, config.learning_rate, config.weight_decay, (config.adam_beta1, config.adam_beta2), config.adam_epsilon
    )
    train_loader, eval_loader = build_dataloaders(config, data)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    plan = plan_steps(run, model, train_loader)  # optimizer steps, in all and per epoch
    compiled = compile_model(config, accelerator, model, train_loader, plan.micro_batches, log)  # torch_compile
    schedule = build_scheduler(config.lr_scheduler_type, optimizer, plan.total_steps, config.warmup_ratio)
    lr_scheduler = accelerator.prepare(schedule)

    # --- resume (or start), then train: the loop's bookkeeping is tunebook.training.loop
    def run_evaluation() -> dict:
        return evaluate(config, model, data, eval_loader, accelerator)

    evaluation = run_evaluation if eval_loader is not None else None
    figures = LossWindow(accelerator.device)  # the logged loss: a mean over examples
    saved = load_checkpoint_or_start(run, optimizer, lr_scheduler, train_loader, figures, evaluation is not None)
    loop = start_training(run, plan, saved, model, optimizer, lr_scheduler, train_loader, data, evaluation, compiled)
    model.train()
    k = config.gradient_accumulation_steps
    for loader in epochs(run, loop):
        for window in accumulation_windows(loader, k, run.timer):
            # Mean over the examples of the whole step (all micro-batches and processes), not per micro-batch.
            local_examples = sum(torch.tensor(len(b["labels"]), device=accelerator.device) for b in window)
            scale = step_loss_scale(accelerator.reduce(local_examples, "sum"), accelerator.num_processes, k)
            step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
            for batch in window:
                with micro_batch(accelerator, model, last=batch is window[-1]):
                    logits = model(**classifier_inputs(batch)).logits
                    loss_sum = F.cross_entropy(logits.float(), batch["labels"], reduction="sum")
                    accelerator.backward(loss_sum * scale)
                step_loss += loss_sum.detach().double()
                loop.counters.add_batch(batch)  # tokens, padding and examples, for the logs and the summary
            # The step: clip, the finite check on every process, the update (or nan_policy's skip), the schedule.
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm or float("inf"))
            finite = finite_on_every_process(step_loss, grad_norm, accelerator)
            updated = optimizer_step_or_skip(run, loop.state, optimizer, finite)  # fp16: the scaler's step
            learning_rate = lr_scheduler.get_last_lr()[0]  # the rate this step trained at
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if updated:
                figures.add(step_loss, local_examples)
            if after_step(run, loop, window, grad_norm, learning_rate):  # log, evaluate, save, stop
                break

    # --- final evaluation (the best checkpoint's weights with load_best_model_at_end) and outputs
    return finish(run, loop, headline=("eval_accuracy", "accuracy", ".3f"), labels=data.label_names)


if __name__ == "__main__":
    main(load_config(ClassifyConfig))
