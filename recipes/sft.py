"""Supervised fine-tuning (SFT) of a causal language model on instruction or chat data.

With no arguments it runs the embedded offline default: it generates a synthetic digit task, trains a
tokenizer locally, builds a tiny Llama from a config, fine-tunes it and reports the exact match of its greedy
answers on a held-out split before and after training.

    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/sft.py                # CPU
    accelerate launch --config_file accelerate_configs/multi_cpu.yaml recipes/sft.py          # 2 CPU processes
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/sft.py \\
        --config recipes/configs/sft/smollm2_135m_code_alpaca.yaml                           # one GPU
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/sft.py --config ...  # DDP

Any config key can be overridden: `--learning_rate 1e-4` or `--learning_rate=1e-4` (`--help` lists them).
Outputs in `output_dir`: the model and tokenizer (safetensors, `from_pretrained`-ready), `config.yaml`,
`metrics.jsonl`, `summary.json`, and `checkpoints/step-N/` when `save_steps` is set.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from tunebook.checkpoint import save_checkpoint, save_final_model
from tunebook.config import config_to_dict, load_config, save_config
from tunebook.data import (
    PadCollator,
    build_loader,
    conversation_texts,
    default_cache_dir,
    fingerprint_sources,
    format_loss_mask,
    load_conversations,
    parse_sources,
    prepare_sft_dataset,
    write_synthetic_task,
)
from tunebook.evaluation import evaluate_loss, generation_exact_match
from tunebook.logging import MetricsWriter, RunTimer, peak_rss_mb, setup_logging, versions, write_summary
from tunebook.models import TINY_LLAMA, build_causal_lm, load_or_train_tokenizer, load_tokenizer
from tunebook.recipe_configs import SFTConfig
from tunebook.training import (
    accumulation_windows,
    build_accelerator,
    build_optimizer,
    build_scheduler,
    count_loss_tokens,
    step_loss_scale,
    token_loss_sum,
    total_optimizer_steps,
)


def build_datasets(config: SFTConfig, cache_dir: Path, log):
    """Tokenizer, tokenised train set and eval set (or None), from the cache when nothing changed."""
    train_sources = parse_sources(config.train_data, "train_data")
    eval_sources = parse_sources(config.eval_data, "eval_data")
    if not train_sources:  # the embedded default: generate the synthetic task
        train_path, eval_path = write_synthetic_task(
            cache_dir / "synthetic", config.synthetic_train_size, config.synthetic_eval_size, config.seed
        )
        train_sources = parse_sources(str(train_path), "train_data")
        eval_sources = eval_sources or parse_sources(str(eval_path), "eval_data")

    if config.tokenizer_name_or_path or config.model_name_or_path:
        tokenizer = load_tokenizer(config.tokenizer_name_or_path or config.model_name_or_path)
    else:
        tokenizer, trained = load_or_train_tokenizer(
            cache_dir,
            fingerprint_sources(train_sources),
            lambda: conversation_texts(load_conversations(train_sources, config.data_format, cache_dir, config.seed)),
            config.tokenizer_vocab_size,
        )
        log.info(
            "%s a %d-token BPE tokenizer on the training data", "Trained" if trained else "Reusing", len(tokenizer)
        )

    def prepare(sources, name):
        dataset, stats, cached = prepare_sft_dataset(
            sources,
            tokenizer,
            data_format=config.data_format,
            max_seq_length=config.max_seq_length,
            overlong=config.overlong_examples,
            assistant_only_loss=config.assistant_only_loss,
            cache_dir=cache_dir,
            seed=config.seed,
            num_proc=config.dataset_num_proc,
        )
        how = "loaded from cache, no tokenisation" if cached else "tokenised and cached"
        log.info("%s data: %d examples (%s); %s", name, len(dataset), how, stats)
        if stats["truncated"] or stats["dropped_overlong"] or stats["dropped_no_loss_tokens"]:
            log.warning(
                "%s data: %d truncated and %d dropped at max_seq_length=%d, %d dropped with no loss-bearing "
                "token left",
                name,
                stats["truncated"],
                stats["dropped_overlong"],
                config.max_seq_length,
                stats["dropped_no_loss_tokens"],
            )
        return dataset, stats

    train_set, stats = prepare(train_sources, "train")
    eval_set = prepare(eval_sources, "eval")[0] if eval_sources else None
    if eval_set is None and config.eval_split_ratio > 0:
        split = train_set.train_test_split(test_size=config.eval_split_ratio, seed=config.seed)
        train_set, eval_set = split["train"], split["test"]
    return tokenizer, train_set, eval_set, stats


def build_dataloaders(config: SFTConfig, tokenizer, train_set, eval_set):
    collate = PadCollator(tokenizer.pad_token_id, config.pad_to_multiple_of)
    common = {
        "collate_fn": collate,
        "seed": config.seed,
        "num_workers": config.dataloader_num_workers,
        "pin_memory": config.dataloader_pin_memory,
    }
    columns = ["input_ids", "labels"]
    train_loader = build_loader(
        train_set.select_columns(columns), config.per_device_train_batch_size, shuffle=True, **common
    )
    eval_loader = None
    if eval_set is not None:
        eval_loader = build_loader(
            eval_set.select_columns(columns), config.per_device_eval_batch_size, shuffle=False, **common
        )
    return train_loader, eval_loader


def evaluate(config: SFTConfig, model, tokenizer, eval_loader, eval_set, accelerator, log) -> dict:
    metrics = evaluate_loss(model, eval_loader, accelerator, disable_tqdm=config.disable_tqdm)
    if config.generation_eval:
        scores, samples = generation_exact_match(
            model,
            tokenizer,
            eval_set,
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
    accelerator = build_accelerator(config.gradient_accumulation_steps)
    log = setup_logging(accelerator.is_main_process, config.log_level)
    set_seed(config.seed)
    output_dir = Path(config.output_dir)
    cache_dir = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
    if accelerator.is_main_process:
        save_config(config, output_dir / "config.yaml")
    log.info("Resolved config:\n%s", "\n".join(f"  {k}: {v!r}" for k, v in config_to_dict(config).items()))
    log.info(
        "%d process(es), device %s, mixed precision %s",
        accelerator.num_processes,
        accelerator.device,
        accelerator.mixed_precision,
    )

    # --- data: the main process tokenises into the cache, the others then map the same files
    with accelerator.main_process_first():
        tokenizer, train_set, eval_set, data_stats = build_datasets(config, cache_dir, log)
    log.info(
        "One training example, loss-bearing text in [[...]]:\n%s",
        format_loss_mask(tokenizer, train_set[0]["input_ids"], train_set[0]["labels"]),
    )

    # --- model, optimizer, loaders
    model = build_causal_lm(
        tokenizer,
        model_name_or_path=config.model_name_or_path,
        model_config=config.model_config or (None if config.model_name_or_path else TINY_LLAMA),
        attn_implementation=config.attn_implementation,
        gradient_checkpointing=config.gradient_checkpointing,
    )
    log.info("Model: %s, %.2fM parameters", type(model).__name__, sum(p.numel() for p in model.parameters()) / 1e6)
    optimizer = build_optimizer(
        model, config.learning_rate, config.weight_decay, (config.adam_beta1, config.adam_beta2), config.adam_epsilon
    )
    train_loader, eval_loader = build_dataloaders(config, tokenizer, train_set, eval_set)
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

    metrics_log = MetricsWriter(output_dir / "metrics.jsonl", accelerator.is_main_process)
    eval_history = {}
    if eval_loader is not None and config.eval_on_start:
        eval_history[0] = evaluate(config, model, tokenizer, eval_loader, eval_set, accelerator, log)
        log.info("Before training: %s", eval_history[0])
        metrics_log.write({"step": 0, **eval_history[0]})

    # --- training loop
    global_step, epoch = 0, 0
    # Counters stay on the device so the loop never waits for a host sync outside logging steps.
    tokens_seen = torch.zeros((), dtype=torch.long, device=accelerator.device)  # non-padding input tokens
    fed_tokens = torch.zeros((), dtype=torch.long, device=accelerator.device)  # all input tokens, padding included
    window_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    window_tokens = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    final_train_loss = None
    progress = tqdm(total=total_steps, desc="Training", disable=config.disable_tqdm or not accelerator.is_main_process)
    model.train()
    timer.start_training()
    while global_step < total_steps:
        train_loader.set_epoch(epoch)
        for window in accumulation_windows(train_loader, k):
            # Normalise by the loss tokens of the whole step (all micro-batches, all processes), not per micro-batch.
            local_tokens = sum(count_loss_tokens(b["labels"]) for b in window)
            scale = step_loss_scale(accelerator.reduce(local_tokens, "sum"), accelerator.num_processes, k)
            for batch in window:
                with accelerator.accumulate(model):
                    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                    loss_sum = token_loss_sum(logits, batch["labels"])
                    accelerator.backward(loss_sum * scale)
                window_loss += loss_sum.detach().double()
                tokens_seen += batch["attention_mask"].sum()
                fed_tokens += batch["attention_mask"].numel()
            window_tokens += local_tokens
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm or float("inf"))
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            timer.step_done()
            progress.update(1)

            if global_step % config.logging_steps == 0 or global_step == total_steps:
                loss_total, loss_tokens = accelerator.reduce(torch.stack([window_loss, window_tokens]), "sum").tolist()
                all_tokens = int(accelerator.reduce(tokens_seen, "sum"))
                final_train_loss = loss_total / max(loss_tokens, 1)
                record = {
                    "step": global_step,
                    "epoch": round(global_step / steps_per_epoch, 3),
                    "loss": final_train_loss,
                    "learning_rate": lr_scheduler.get_last_lr()[0],
                    "grad_norm": float(grad_norm),
                    "tokens_per_second": timer.rate_since_mark(all_tokens),
                    "train_tokens": all_tokens,
                }
                metrics_log.write(record)
                progress.set_postfix(
                    loss=f"{final_train_loss:.4f}",
                    lr=f"{record['learning_rate']:.2e}",
                    tok_s=f"{record['tokens_per_second']:.0f}",
                )
                window_loss.zero_()
                window_tokens.zero_()
            if (
                eval_loader is not None
                and config.eval_steps
                and global_step % config.eval_steps == 0
                and global_step < total_steps
            ):
                eval_history[global_step] = evaluate(config, model, tokenizer, eval_loader, eval_set, accelerator, log)
                log.info("Step %d: %s", global_step, eval_history[global_step])
                metrics_log.write({"step": global_step, **eval_history[global_step]})
            if config.save_steps and global_step % config.save_steps == 0:
                save_checkpoint(
                    accelerator,
                    output_dir,
                    global_step,
                    config,
                    {"epoch": epoch, "tokens_seen": int(tokens_seen)},
                    config.save_total_limit,
                )
            if global_step >= total_steps:
                break
        epoch += 1
    progress.close()
    train_runtime = timer.train_runtime()

    # --- final evaluation and outputs
    final_eval = {}
    if eval_loader is not None:
        final_eval = evaluate(config, model, tokenizer, eval_loader, eval_set, accelerator, log)
        metrics_log.write({"step": global_step, **final_eval})
    if total_steps > 0:
        save_final_model(accelerator, model, tokenizer, output_dir)
    counts = accelerator.reduce(torch.stack([tokens_seen, fed_tokens]), "sum").tolist()
    summary = {
        "recipe": "sft",
        "train_steps": global_step,
        "train_tokens": int(counts[0]),
        "train_runtime_seconds": train_runtime,
        "train_tokens_per_second": counts[0] / train_runtime if train_runtime > 0 else 0.0,
        "time_to_first_step_seconds": timer.time_to_first_step,
        "final_train_loss": final_train_loss,
        "eval": final_eval,
        "eval_before_training": eval_history.get(0, {}),
        "padding_fraction": 1 - counts[0] / counts[1] if counts[1] else 0.0,
        "data": data_stats,
        "peak_rss_mb": peak_rss_mb(),
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "versions": versions(),
        "output_dir": str(output_dir),
    }
    if accelerator.is_main_process:
        write_summary(output_dir / "summary.json", summary)
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
