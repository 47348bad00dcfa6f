"""Supervised fine-tuning (SFT) of a causal language model on instruction or chat data.

With no arguments it runs the embedded offline default: it generates a synthetic digit task, trains a
tokenizer locally, builds a tiny Llama from a config, fine-tunes it and reports the exact match of its greedy
answers on a held-out split before and after training. A vision-language model (`AutoModelForImageTextToText`)
trains on conversations with images the same way (recipes/configs/sft/vlm_default.yaml: coloured shapes, a tiny
Qwen2-VL): its processor tokenises, and the loader's workers decode the images.

    tunebook train --config_file accelerate_configs/cpu.yaml sft                    # CPU
    tunebook train --config_file accelerate_configs/multi_cpu.yaml sft              # 2 CPU processes
    tunebook train --config_file accelerate_configs/single_gpu.yaml sft \\
        --config recipes/configs/sft/code_alpaca_smollm2.yaml                       # one GPU
    tunebook train --config_file accelerate_configs/multi_gpu.yaml sft --config ... # DDP

`tunebook train` is `accelerate launch recipes/sft.py` (the same options, before the recipe) that checks the config
first and ends a failed or stopped run with the recipe's own lines, not the launcher's traceback.

Any config key can be overridden: `--learning_rate 1e-4` or `--learning_rate=1e-4` (`--help` lists them).
Outputs in `output_dir`: the model and tokenizer or processor (safetensors, `from_pretrained`-ready), `config.yaml`,
`metrics.jsonl`, `summary.json`, and `checkpoints/step-N/` when `save_steps` is set.
"""

from __future__ import annotations

import torch

from tunebook import compat
from tunebook.config import SFTConfig, load_config
from tunebook.data import (
    PackedCollator,
    PadCollator,
    SFTData,
    VisionCollator,
    VisionPackedCollator,
    VisionPromptCollator,
    attention_inputs,
    example_lengths,
    format_loss_mask,
    image_columns,
    packing_mechanism,
    prepare_sft_or_vision_data,
    train_and_eval_loaders,
    use_packed_attention,
)
from tunebook.distributed import prepare_then_join
from tunebook.evaluation import evaluate_loss, generation_exact_match, log_samples, prompt_sampler
from tunebook.models import (
    apply_lora,
    build_chat_lm,
    describe_parameters,
)
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


def build_dataloaders(config: SFTConfig, data: SFTData, num_processes: int, attn: str, model_config):
    """Packed rows, or examples (batched by similar length with group_by_length); workers collate in the background."""
    pad_id, multiple = data.tokenizer.pad_token_id, config.pad_to_multiple_of
    collate = PackedCollator(pad_id, multiple, attn) if config.packing else PadCollator(pad_id, multiple)
    columns = ["input_ids", "labels", "seq_lengths"] if config.packing else ["input_ids", "labels"]
    if data.processor is not None:  # a vision-language model's rows: their images decoded in the workers
        processor, pixels = data.processor, config.max_image_pixels
        if config.packing:  # each example's images ride with it; Qwen-VL's positions per example need the config
            collate = VisionPackedCollator(processor, model_config, multiple, attn, pixels)
        else:
            collate = VisionCollator(processor, multiple, pixels)
        columns += image_columns(data.train)  # images, where (and what packing or cache_pixel_values added)
    grouping = {}
    if config.group_by_length and not config.packing:  # packed rows are all about max_seq_length long
        global_batch = config.per_device_train_batch_size * num_processes * config.gradient_accumulation_steps
        grouping = {"lengths": example_lengths(data.train), "group_size": global_batch}
    evaluation = data.eval.select_columns(columns) if data.eval is not None else None
    # streaming: true: the loader's workers tokenise (and pack) the stream as training reads it
    train = data.stream if data.stream is not None else data.train.select_columns(columns)
    return train_and_eval_loaders(config, train, evaluation, collate, **grouping)


def evaluate(config: SFTConfig, model, data: SFTData, eval_loader, attn: str, accelerator, log, step: int) -> dict:
    vision = data.processor is not None
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
            # a vision-language model's prompts come with their images
            collate_fn=VisionPromptCollator(data.processor, config.max_image_pixels) if vision else None,
        )
        metrics.update(scores)
        log_samples(log, samples[:3], step)
    return metrics


def main(config: SFTConfig) -> dict:
    run = start_run(config, "sft")  # Accelerator, logging, seed, output_dir locked
    accelerator, log = run.accelerator, run.log

    # --- data: prepared under a file lock (the first process builds, the others map the files), then all meet
    # A vision-language model's data (rows with image references, its processor in data.processor), else text.
    data = prepare_then_join(accelerator, config, prepare_sft_or_vision_data, run.cache_dir, log)
    tokenizer = data.tokenizer
    log.info(
        "One training %s, loss-bearing text in [[...]]:\n%s",
        "row" if config.packing else "example",
        format_loss_mask(tokenizer, data.train[0]["input_ids"], data.train[0]["labels"]),
    )

    # --- model, optimizer, loaders
    # a vision-language model (data.processor): its vision tower frozen (freeze_vision_tower)
    model = build_chat_lm(tokenizer, data.processor, config)
    if config.use_peft:  # LoRA: the base stays frozen; checkpoints and the output hold only the adapters
        model = apply_lora(model, config)  # a VLM's all-linear: its language model's layers
    log.info("Model: %s, %s", type(model).__name__, describe_parameters(model))
    attn, dtype = compat.attn_implementation(model.config), model.dtype
    if config.packing:  # on a CPU, sdpa becomes our per-example (varlen) SDPA
        attn = use_packed_attention(model, accelerator.device, config.max_seq_length)
        log.info("Packing with %s attention: %s", attn, packing_mechanism(attn))
    optimizer = build_optimizer(
        model, config.learning_rate, config.weight_decay, (config.adam_beta1, config.adam_beta2), config.adam_epsilon
    )
    train_loader, eval_loader = build_dataloaders(config, data, accelerator.num_processes, attn, model.config)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    plan = plan_steps(run, model, train_loader)  # optimizer steps, in all and per epoch
    compiled = compile_model(config, accelerator, model, train_loader, plan.micro_batches, log)  # torch_compile
    schedule = build_scheduler(config.lr_scheduler_type, optimizer, plan.total_steps, config.warmup_ratio)
    lr_scheduler = accelerator.prepare(schedule)

    # --- resume (or start), then train: the loop's bookkeeping is tunebook.training.loop
    def run_evaluation() -> dict:
        return evaluate(config, model, data, eval_loader, attn, accelerator, log, saved.state.global_step)

    evaluation = run_evaluation if eval_loader is not None else None
    figures = LossWindow(accelerator.device)  # the logged loss: a mean over loss tokens
    saved = load_checkpoint_or_start(run, optimizer, lr_scheduler, train_loader, figures, evaluation is not None)
    samples = prompt_sampler(config, model, tokenizer, accelerator)  # sample_prompts, at each evaluation
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
                    # Logits only where a label is: prompt and padding positions carry no loss.
                    loss_sum = causal_lm_token_losses(model, attention_inputs(batch, attn, dtype), batch)[0].sum()
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
                figures.add(step_loss, local_tokens)
            if after_step(run, loop, window, grad_norm, learning_rate):  # log, evaluate, save, stop
                break

    # --- final evaluation (the best checkpoint's weights with load_best_model_at_end) and outputs
    return finish(run, loop, headline=("eval_exact_match", "exact match", ".3f"))


if __name__ == "__main__":
    main(load_config(SFTConfig))
