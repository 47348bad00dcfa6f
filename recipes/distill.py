"""Knowledge distillation of a causal language model (the student) from a teacher that shares its tokenizer: GKD.

With no arguments it runs the embedded offline default: it generates the SFT default's digit task, trains a
tokenizer locally, builds a tiny Llama teacher and teaches it the task (`teacher_warmup_steps` of SFT), then distills
it into a student of half its depth and reports the exact match of the student's greedy answers on a held-out split
before and after, beside the teacher's.

    tunebook train --config_file accelerate_configs/cpu.yaml distill                       # CPU
    tunebook train --config_file accelerate_configs/multi_cpu.yaml distill                 # 2 CPU processes
    tunebook train --config_file accelerate_configs/single_gpu.yaml distill \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --teacher_model_name_or_path Qwen/Qwen2.5-7B-Instruct \\
        --train_data data.jsonl                                                            # one GPU

The loss is TRL's generalized Jensen-Shannon divergence between the two models' next-token distributions at the
completion's tokens (`beta`: 0 forward KL, 1 reverse KL), at `temperature`, optionally mixed with the plain
cross-entropy (`alpha`), normalised over the loss tokens of the whole step as SFT's is. The completions are the
data's, the student's own samples on a share `lmbda` of the steps (on-policy, through the RL generation backend),
or with `seq_kd` the teacher's. The teacher runs without gradients, in bf16 where the GPU computes in it, and under
DeepSpeed ZeRO-3 partitioned as DPO's reference is; neither model's logits exist for all positions at once.
Outputs in `output_dir` as for SFT: the student, `config.yaml`, `metrics.jsonl`, `summary.json` (with the
teacher's exact match), `report.png` and `checkpoints/step-N/`.
"""

from __future__ import annotations

import torch

from tunebook import compat
from tunebook.config import DistillConfig, load_config
from tunebook.data import (
    PadCollator,
    SFTData,
    attention_inputs,
    example_lengths,
    format_loss_mask,
    prepare_sft_data,
    train_and_eval_loaders,
)
from tunebook.distillation import (
    build_teacher,
    completion_sampling,
    distill_token_losses,
    is_on_policy_step,
    sampled_batch,
)
from tunebook.distributed import prepare_then_join
from tunebook.evaluation import evaluate_loss, generation_exact_match, log_samples, prompt_sampler
from tunebook.models import apply_lora, build_causal_lm, describe_parameters, model_options
from tunebook.preference import partition_reference
from tunebook.rl.generation import TransformersBackend
from tunebook.training import (
    LossWindow,
    accumulation_windows,
    after_step,
    build_optimizer,
    build_scheduler,
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


def build_dataloaders(config: DistillConfig, data: SFTData, num_processes: int):
    """Padded examples (batched by similar length with group_by_length), as SFT's unpacked ones."""
    grouping = {}
    if config.group_by_length:
        global_batch = config.per_device_train_batch_size * num_processes * config.gradient_accumulation_steps
        grouping = {"lengths": example_lengths(data.train), "group_size": global_batch}
    columns = ["input_ids", "labels"]
    evaluation = data.eval.select_columns(columns) if data.eval is not None else None
    collate = PadCollator(data.tokenizer.pad_token_id, config.pad_to_multiple_of)
    return train_and_eval_loaders(config, data.train.select_columns(columns), evaluation, collate, **grouping)


def exact_match(config: DistillConfig, model, data: SFTData, accelerator) -> tuple[dict, list]:
    return generation_exact_match(
        model,
        data.tokenizer,
        data.eval_examples,
        accelerator,
        batch_size=config.per_device_eval_batch_size,
        max_new_tokens=config.generation_max_new_tokens,
        max_samples=config.generation_eval_max_samples or None,
        disable_tqdm=config.disable_tqdm,
    )


def evaluate(config: DistillConfig, model, data: SFTData, eval_loader, attn: str, accelerator, log, step: int) -> dict:
    """The student's cross-entropy on the eval data's completions and, with generation_eval, its exact match."""
    metrics = evaluate_loss(model, eval_loader, accelerator, attn, disable_tqdm=config.disable_tqdm)
    if config.generation_eval:
        scores, samples = exact_match(config, model, data, accelerator)
        metrics.update(scores)
        log_samples(log, samples[:3], step)
    return metrics


def teacher_exact_match(config: DistillConfig, teacher, data: SFTData, accelerator, log) -> dict:
    """The teacher's exact match, once: what the student is measured against (`teacher_eval_exact_match`)."""
    if not config.generation_eval or data.eval_examples is None:
        return {}
    scores = {"teacher_" + k: v for k, v in exact_match(config, teacher, data, accelerator)[0].items()}
    log.info("Teacher: %s", scores)
    return scores


def main(config: DistillConfig) -> dict:
    run = start_run(config, "distill")  # Accelerator, logging, seed, output_dir locked
    accelerator, log = run.accelerator, run.log

    # --- data: SFT's, prepared under a file lock (the first process builds, the others map the files), then all meet
    data = prepare_then_join(accelerator, config, prepare_sft_data, run.cache_dir, log)
    tokenizer = data.tokenizer
    example = data.train[0]
    shown = format_loss_mask(tokenizer, example["input_ids"], example["labels"])
    log.info("One training example, loss-bearing text in [[...]]:\n%s", shown)

    # --- models: the student; the teacher (trained on the task first when built fresh), frozen
    model = build_causal_lm(tokenizer, model_options(config))
    attn, dtype = compat.attn_implementation(model.config), model.dtype
    teacher = build_teacher(config, data, accelerator.device, dtype, log)
    teacher_attn, teacher_dtype = compat.attn_implementation(teacher.config), teacher.dtype
    if config.use_peft:  # LoRA: the base stays frozen; checkpoints and the output hold only the adapters
        model = apply_lora(model, config)
    log.info("Student: %s, %s", type(model).__name__, describe_parameters(model))

    # --- optimizer, loaders
    optimizer = build_optimizer(
        model, config.learning_rate, config.weight_decay, (config.adam_beta1, config.adam_beta2), config.adam_epsilon
    )
    train_loader, eval_loader = build_dataloaders(config, data, accelerator.num_processes)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    teacher = partition_reference(accelerator, teacher)  # under ZeRO-3 sharded as the student is
    plan = plan_steps(run, model, train_loader)  # optimizer steps, in all and per epoch
    compiled = compile_model(config, accelerator, model, train_loader, plan.micro_batches, log)  # torch_compile
    schedule = build_scheduler(config.lr_scheduler_type, optimizer, plan.total_steps, config.warmup_ratio)
    lr_scheduler = accelerator.prepare(schedule)
    teacher_scores = teacher_exact_match(config, teacher, data, accelerator, log)
    gkd = (config.beta, config.lmbda, config.temperature, config.seq_kd, config.alpha)
    log.info("GKD: beta %g, lmbda %g, temperature %g, seq_kd %s, alpha %g", *gkd)

    # --- sampled completions: the student's (lmbda) and the teacher's (seq_kd), through the RL generation backend
    student_sampler = TransformersBackend(model, accelerator.device)
    teacher_sampler = TransformersBackend(teacher, accelerator.device) if config.seq_kd else None
    sampling = completion_sampling(config, model, tokenizer)  # at temperature, up to max_new_tokens

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
            # The step's completions: the student's own (a share lmbda of the steps), else the teacher's (seq_kd),
            # else the data's. Sampled before the loss tokens are counted: they set them.
            step = loop.state.global_step
            sampler = student_sampler if is_on_policy_step(config.seed, step, config.lmbda) else teacher_sampler
            if sampler is not None:
                process = accelerator.process_index
                window = [sampled_batch(sampler, b, sampling, config, step, i, process) for i, b in enumerate(window)]
                model.train()  # sampling left it in eval mode
            # Normalise by the loss tokens of the whole step (all micro-batches and processes), not per micro-batch.
            local_tokens = sum(count_loss_tokens(b["labels"]) for b in window)
            scale = step_loss_scale(accelerator.reduce(local_tokens, "sum"), accelerator.num_processes, k)
            step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
            for batch in window:
                with micro_batch(accelerator, model, last=batch is window[-1]):
                    # Both output layers run only where a label is, a chunk of rows at a time; the teacher without
                    # gradients.
                    losses = distill_token_losses(
                        model,
                        teacher,
                        attention_inputs(batch, attn, dtype),
                        attention_inputs(batch, teacher_attn, teacher_dtype),
                        batch,
                        beta=config.beta,
                        temperature=config.temperature,
                        alpha=config.alpha,
                    )[0]
                    loss_sum = losses.sum()
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
    return finish(run, loop, headline=("eval_exact_match", "exact match", ".3f"), **teacher_scores)


if __name__ == "__main__":
    main(load_config(DistillConfig))
