"""The short in-process recipe runs the guarantee tests share: each recipe's tiny task, running it, and reading
what it wrote. A plain module, so that no test module imports another."""

from __future__ import annotations

import json
import signal

from support import ROOT, TINY_TEST_MODEL

from tunebook import load_recipe

COMMON = {"disable_tqdm": True, "report_to": "none", "dataloader_num_workers": 0, "logging_steps": 1,
          "eval_on_start": False, "per_device_train_batch_size": 4, "per_device_eval_batch_size": 8,
          "log_level": "WARNING", "max_steps": 6, "learning_rate": 1e-3}  # fmt: skip
TASKS = {
    "sft": {"model_config": TINY_TEST_MODEL, "synthetic_train_size": 64, "synthetic_eval_size": 8,
            "generation_eval": False},
    "classify": {"synthetic_train_size": 64, "synthetic_eval_size": 16},
    "pretrain": {"model_config": TINY_TEST_MODEL, "synthetic_train_size": 40, "synthetic_eval_size": 8,
                 "max_seq_length": 64},
    "dpo": {"model_config": TINY_TEST_MODEL, "synthetic_train_size": 64, "synthetic_eval_size": 8,
            "sft_warmup_steps": 0},
    # 32 pairs split into 64 rows, as many as the other recipes' examples.
    "kto": {"model_config": TINY_TEST_MODEL, "synthetic_train_size": 32, "synthetic_eval_size": 4,
            "sft_warmup_steps": 0},
    "reward": {"model_config": TINY_TEST_MODEL, "synthetic_train_size": 64, "synthetic_eval_size": 8},
    # A reward that random completions sometimes earn, so advantages, gradients and updates are not all zero.
    "grpo": {"model_config": TINY_TEST_MODEL, "synthetic_train_size": 64, "synthetic_eval_size": 8,
             "sft_warmup_steps": 0, "num_generations": 2, "max_new_tokens": 4,
             "reward_functions": [str(ROOT / "tests" / "recipes" / "grpo_rewards.py") + ":text_length"]},
    # A teacher of the student's size and no warm-up (the planner counts it as DPO's reference); lmbda 0.34: at the
    # default seed, step 3 of 6 trains on the student's samples (and a run resumed after step 2 samples it again).
    "distill": {"model_config": TINY_TEST_MODEL, "teacher_model_config": TINY_TEST_MODEL, "synthetic_train_size": 64,
                "synthetic_eval_size": 8, "generation_eval": False, "teacher_warmup_steps": 0, "lmbda": 0.34,
                "max_new_tokens": 4},
}  # fmt: skip
# What evaluation reports to choose the best model by (GRPO's evaluation has rewards, not a loss).
EVAL_METRIC = {"grpo": "reward"}


def _run(name, out, cache, **overrides):
    recipe = load_recipe(name)
    config = recipe.config(**{**COMMON, **TASKS[name], "output_dir": str(out), "cache_dir": str(cache), **overrides})
    return recipe.main(config)


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out) -> bytes:
    return (out / "model.safetensors").read_bytes()


RATES = (
    "tokens_per_second",
    "samples_per_second",
    "data_wait_fraction",
    "peak_rss_mb",
    "mfu",
    "generation_seconds",
    "training_seconds",
    "waiting_seconds",
)


def _rates(record: dict) -> dict:
    return {k: v for k, v in record.items() if k in RATES}


def _without_rates(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in RATES}


def _signal_at(monkeypatch, name: str, step: int, signum=signal.SIGTERM) -> None:
    """Deliver a real `signum` to this process right after optimizer step `step` of recipe `name`."""
    module = load_recipe(name).module
    real = module.after_step

    def signal_then_after_step(run, loop, *args, **kwargs):
        if loop.state.global_step + 1 == step and run.stop is None:  # the step is taken, not yet counted
            signal.raise_signal(signum)
        return real(run, loop, *args, **kwargs)

    monkeypatch.setattr(module, "after_step", signal_then_after_step)
