"""Reward modelling: train a sequence classifier with one output, the reward, on (prompt, chosen, rejected) pairs with
the Bradley-Terry loss, -log sigmoid(r_chosen - r_rejected - margin).

With no arguments it runs the embedded offline default: it generates preference pairs over the SFT default's digit
task (the right answer chosen, a near miss rejected), trains a tokenizer locally, builds a tiny Llama with a
one-output head from a config, trains it and reports the pairwise accuracy on held-out pairs before and after.

    tunebook train --config_file accelerate_configs/cpu.yaml reward                             # CPU
    tunebook train --config_file accelerate_configs/multi_cpu.yaml reward                       # 2 CPU processes
    tunebook train --config_file accelerate_configs/single_gpu.yaml reward \\
        --model_name_or_path path/to/model --train_data prefs.jsonl --eval_split_ratio 0.05      # one GPU

The data is DPO's (strings or chat messages, an explicit `prompt` column or conversations that share their first
turns), with an optional `margin` column. Outputs in `output_dir` as for the other recipes: the model, which
`AutoModelForSequenceClassification.from_pretrained` loads and a GRPO run takes as `reward_model: output_dir`
(`tunebook.training.load_reward_model`), its tokenizer, `config.yaml`, `metrics.jsonl` (loss, accuracy, margin,
rewards/chosen, rewards/rejected), `summary.json`, `report.png` and `checkpoints/step-N/`.
"""

from __future__ import annotations

import torch

from tunebook.config import RewardConfig, load_config
from tunebook.data import PairCollator, train_and_eval_loaders
from tunebook.distributed import prepare_then_join
from tunebook.models import apply_lora, build_sequence_classifier, describe_parameters, model_options
from tunebook.preference import (
    REWARD_FIGURES,
    PreferenceData,
    RewardStats,
    bradley_terry_loss,
    evaluate_reward_model,
    pair_rewards,
    prepare_preference_data,
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
    start_run,
    start_training,
    step_loss_scale,
)


def build_dataloaders(config: RewardConfig, data: PreferenceData):
    """Batches of pairs, each one padded batch of chosen then rejected sequences; workers collate in the background."""
    collate = PairCollator(data.tokenizer.pad_token_id, config.pad_to_multiple_of)
    return train_and_eval_loaders(config, data.train, data.eval, collate)


def evaluate(config: RewardConfig, model, eval_loader, accelerator) -> dict:
    return evaluate_reward_model(model, eval_loader, accelerator, config.disable_tqdm)


def main(config: RewardConfig) -> dict:
    run = start_run(config, "reward")  # Accelerator, logging, seed, output_dir locked
    accelerator, log = run.accelerator, run.log

    # --- data: prepared under a file lock (the first process builds, the others map the files), then all meet
    data = prepare_then_join(accelerator, config, prepare_preference_data, run.cache_dir, log)
    tokenizer = data.tokenizer
    pair = data.train[0]  # what the model scores: the whole conversation, its reward read at the last token
    log.info(
        "One training pair%s:\nchosen:   %s\nrejected: %s",
        f" (margin {pair['margin']:g})" if "margin" in pair else "",
        tokenizer.decode(pair["chosen_input_ids"]),
        tokenizer.decode(pair["rejected_input_ids"]),
    )

    # --- model: a sequence classifier whose one output is the reward (a loaded model gets a fresh head)
    model = build_sequence_classifier(tokenizer, ["reward"], model_options(config), problem_type="regression")
    if config.use_peft:  # LoRA: the base stays frozen; checkpoints and the output hold only the adapters (and head)
        model = apply_lora(model, config, "classification")
    log.info("Model: %s, %s", type(model).__name__, describe_parameters(model))

    # --- optimizer, loaders
    optimizer = build_optimizer(
        model, config.learning_rate, config.weight_decay, (config.adam_beta1, config.adam_beta2), config.adam_epsilon
    )
    train_loader, eval_loader = build_dataloaders(config, data)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    plan = plan_steps(run, model, train_loader, "pairs")  # optimizer steps, in all and per epoch
    compiled = compile_model(config, accelerator, model, train_loader, plan.micro_batches, log)  # torch_compile
    schedule = build_scheduler(config.lr_scheduler_type, optimizer, plan.total_steps, config.warmup_ratio)
    lr_scheduler = accelerator.prepare(schedule)

    # --- resume (or start), then train: the loop's bookkeeping is tunebook.training.loop
    def run_evaluation() -> dict:
        return evaluate(config, model, eval_loader, accelerator)

    evaluation = run_evaluation if eval_loader is not None else None
    figures = RewardStats(accelerator.device, REWARD_FIGURES)  # loss, rewards, accuracy: means over the pairs
    saved = load_checkpoint_or_start(run, optimizer, lr_scheduler, train_loader, figures, evaluation is not None)
    loop = start_training(run, plan, saved, model, optimizer, lr_scheduler, train_loader, data, evaluation, compiled)
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
                    # One forward of chosen + rejected (2B rows): both rewards from the same weights and batch.
                    losses, chosen, rejected = bradley_terry_loss(pair_rewards(model, batch), batch.get("margin"))
                    accelerator.backward(losses.sum() * scale)
                step_loss += losses.detach().sum().double()
                step_rewards.append((losses.detach(), chosen, rejected))
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
    return finish(run, loop, headline=("eval_accuracy", "pairwise accuracy", ".3f"))


if __name__ == "__main__":
    main(load_config(RewardConfig))
