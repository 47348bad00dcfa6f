"""Continued pretraining of a causal language model on plain text.

With no arguments it runs the embedded offline default: it generates topical text documents, trains a tokenizer
locally, builds a tiny Llama from a config and trains it on every token, reporting eval loss and perplexity before
and after. Documents end with EOS and are cut into rows of max_seq_length; attention never crosses a document.

    tunebook train --config_file accelerate_configs/cpu.yaml pretrain                           # CPU
    tunebook train --config_file accelerate_configs/multi_cpu.yaml pretrain                     # 2 CPU processes
    tunebook train --config_file accelerate_configs/single_gpu.yaml pretrain \\
        --model_name_or_path path/to/model --train_data corpus.txt --eval_split_ratio 0.05       # one GPU

Any config key can be overridden: `--learning_rate 1e-4` (`--help` lists them). Outputs in `output_dir`: the
model and tokenizer (safetensors, `from_pretrained`-ready), `config.yaml`, `metrics.jsonl`, `summary.json`, and
`checkpoints/step-N/` when checkpoints are saved.
"""

from __future__ import annotations

import torch

from tunebook.config import PretrainConfig, load_config
from tunebook.data import (
    PackedCollator,
    TextData,
    attention_inputs,
    format_loss_mask,
    packing_mechanism,
    prepare_text_data,
    train_and_eval_loaders,
    use_packed_attention,
)
from tunebook.distributed import prepare_then_join
from tunebook.evaluation import evaluate_loss, prompt_sampler
from tunebook.models import apply_lora, build_causal_lm, describe_parameters, model_options
from tunebook.training import (
    LossWindow,
    accumulation_windows,
    after_step,
    build_optimizer,
    build_scheduler,
    causal_lm_token_losses,
    compile_model,
    count_loss_tokens,
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


def build_dataloaders(config: PretrainConfig, data: TextData, attn: str):
    """Rows of max_seq_length tokens with their document boundaries; workers collate in the background (and with
    streaming: true tokenise and cut the documents as training reads them)."""
    collate = PackedCollator(data.tokenizer.pad_token_id, config.pad_to_multiple_of, attn)
    train = data.stream if data.stream is not None else data.train
    return train_and_eval_loaders(config, train, data.eval, collate)


def evaluate(config: PretrainConfig, model, eval_loader, attn: str, accelerator) -> dict:
    return evaluate_loss(model, eval_loader, accelerator, attn, disable_tqdm=config.disable_tqdm)


def main(config: PretrainConfig) -> dict:
    run = start_run(config, "pretrain")  # Accelerator, logging, seed, output_dir locked
    accelerator, log = run.accelerator, run.log

    # --- data: prepared under a file lock (the first process builds, the others map the files), then all meet
    data = prepare_then_join(accelerator, config, prepare_text_data, run.cache_dir, log)
    tokenizer = data.tokenizer
    log.info(
        "One training row, loss-bearing text in [[...]]:\n%s",
        format_loss_mask(tokenizer, data.train[0]["input_ids"], data.train[0]["labels"]),
    )

    # --- model, optimizer, loaders
    model = build_causal_lm(tokenizer, model_options(config))
    if config.use_peft:  # LoRA: the base stays frozen; checkpoints and the output hold only the adapters
        model = apply_lora(model, config)
    log.info("Model: %s, %s", type(model).__name__, describe_parameters(model))
    # Rows hold several documents: on a CPU, sdpa becomes our per-document (varlen) SDPA.
    unpacked = "train it with recipes/sft.py and packing: false (pretrain always packs documents into rows)"
    attn, dtype = use_packed_attention(model, accelerator.device, config.max_seq_length, fix=unpacked), model.dtype
    log.info("Documents kept apart with %s attention: %s", attn, packing_mechanism(attn))
    optimizer = build_optimizer(
        model, config.learning_rate, config.weight_decay, (config.adam_beta1, config.adam_beta2), config.adam_epsilon
    )
    train_loader, eval_loader = build_dataloaders(config, data, attn)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    plan = plan_steps(run, model, train_loader)  # optimizer steps, in all and per epoch
    compiled = compile_model(config, accelerator, model, train_loader, plan.micro_batches, log)  # torch_compile
    schedule = build_scheduler(config.lr_scheduler_type, optimizer, plan.total_steps, config.warmup_ratio)
    lr_scheduler = accelerator.prepare(schedule)

    # --- resume (or start), then train: the loop's bookkeeping is tunebook.training.loop
    def run_evaluation() -> dict:
        return evaluate(config, model, eval_loader, attn, accelerator)

    evaluation = run_evaluation if eval_loader is not None else None
    figures = LossWindow(accelerator.device)  # the logged loss: a mean over loss tokens
    saved = load_checkpoint_or_start(run, optimizer, lr_scheduler, train_loader, figures, evaluation is not None)
    samples = prompt_sampler(config, model, tokenizer, accelerator, chat=False)  # sample_prompts, at each evaluation
    loop = start_training(
        run, plan, saved, model, optimizer, lr_scheduler, train_loader, data, evaluation, compiled, samples
    )
    model.train()
    k = config.gradient_accumulation_steps
    for loader in epochs(run, loop):
        for window in accumulation_windows(loader, k, run.timer):
            # Normalise by the loss tokens of the whole step (all micro-batches and processes), not per micro-batch.
            local_tokens = sum(count_loss_tokens(b["labels"]) for b in window)
            scale = step_loss_scale(accelerator.reduce(local_tokens, "sum"), accelerator.num_processes, k)
            step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
            for batch in window:
                with micro_batch(accelerator, model, last=batch is window[-1]):
                    # Every token but a document's first carries a label: the output layer runs where they are.
                    loss_sum = causal_lm_token_losses(model, attention_inputs(batch, attn, dtype), batch)[0].sum()
                    accelerator.backward(loss_sum * scale)
                step_loss += loss_sum.detach().double()
                loop.counters.add_batch(batch)  # tokens, padding and documents, for the logs and the summary
            # The step: clip, the finite check on every process, the update (or nan_policy's skip), the schedule.
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm or float("inf"))
            finite = finite_on_every_process(step_loss, grad_norm, accelerator)
            updated = optimizer_step_or_skip(run, loop.state, optimizer, finite)  # fp16: the scaler's step
            learning_rate = lr_scheduler.get_last_lr()[0]  # the rate this step trained at
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if updated:
                figures.add(step_loss, local_tokens)
            if after_step(run, loop, window, grad_norm, learning_rate):  # log, evaluate, save, stop
                break

    # --- final evaluation (the best checkpoint's weights with load_best_model_at_end) and outputs
    return finish(run, loop, headline=("eval_perplexity", "perplexity", ".2f"))


if __name__ == "__main__":
    main(load_config(PretrainConfig))
