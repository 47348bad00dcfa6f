"""The generation backend interface (`tunebook.rl.generation`) with the transformers backend: what it samples and
the log-probs it reports against the trainer's own computation."""

from __future__ import annotations

import pytest
import torch
from rl_policies import policy as _policy
from rl_policies import rollouts as _rollouts
from rl_policies import tolerance as _tolerance

from tunebook.rl.generation import Sampling, TransformersBackend, stop_id_tuple
from tunebook.rl.grpo import completion_log_probs, sample_completions


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_reported_log_probs_are_the_trainers_log_probs_of_the_sampled_tokens(temperature):
    """The backend's log-probs (recorded during `generate`, KV cache and left padding) equal the trainer's
    recomputation (`completion_log_probs`, one forward of prompt + completion) token for token, float32."""
    model = _policy("linear")
    prompt_ids = [[5, 9, 11, 3], [7, 2], [4, 4, 8]] * 2
    backend = TransformersBackend(model, "cpu")
    sampling = Sampling(max_new_tokens=6, temperature=temperature, stop_token_ids=(1,), pad_token_id=0)
    out = backend.generate(prompt_ids, list(range(6)), sampling)
    assert [len(c) for c in out.token_ids] == [len(lp) for lp in out.log_probs]
    assert out.token_ids == sample_completions(model, prompt_ids, list(range(6)), pad_token_id=0, eos_token_id=[1],
                                               max_new_tokens=6, temperature=temperature, top_p=1.0, device="cpu")  # fmt: skip
    with torch.no_grad():
        trainer, _ = completion_log_probs(model, _rollouts(prompt_ids, out.token_ids), temperature)
    reported = torch.tensor([x for row in out.log_probs for x in row])
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids[0]])).logits
    torch.testing.assert_close(reported, trainer, atol=_tolerance(logits, temperature, 64) * 10, rtol=0)
    # and not at any temperature: untempered log-probs differ
    with torch.no_grad():
        plain, _ = completion_log_probs(model, _rollouts(prompt_ids, out.token_ids), 1.0)
    assert (plain - reported).abs().max() > 1e-3


def test_a_snapshot_samples_the_pushed_weights_not_the_live_ones():
    """async generation samples from a copy: training the policy leaves it alone until `push_weights`."""
    model = _policy("linear")
    backend = TransformersBackend(model, "cpu", snapshot=True)
    prompt_ids, seeds = [[5, 9, 11, 3]] * 4, [0, 1, 2, 3]
    sampling = Sampling(max_new_tokens=5, temperature=1.0, stop_token_ids=(1,), pad_token_id=0)
    before = backend.generate(prompt_ids, seeds, sampling)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)  # "training"
    assert backend.generate(prompt_ids, seeds, sampling).log_probs == before.log_probs
    backend.push_weights(model)
    after = backend.generate(prompt_ids, seeds, sampling)
    live = TransformersBackend(model, "cpu").generate(prompt_ids, seeds, sampling)
    assert after.token_ids == live.token_ids  # the same weights (a copy's kernels may round the last bit apart)
    torch.testing.assert_close(torch.tensor(after.log_probs), torch.tensor(live.log_probs), atol=1e-5, rtol=0)
    assert after.log_probs != before.log_probs


def test_vllm_serve_runs_vllms_server_with_what_the_trainer_needs(monkeypatch):
    from tunebook.cli.vllm_serve import server_command
    from tunebook.errors import ConfigError

    monkeypatch.setattr("tunebook.cli.vllm_serve._cuda", lambda: False)
    command, env = server_command(["--model", "outputs/sft", "--port", "8011"])
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # /collective_rpc and /reset_prefix_cache
    text = " ".join(command)
    assert "--logprobs-mode processed_logprobs" in text and "--port 8011" in text and "--host 0.0.0.0" in text
    assert "--gpu-memory-utilization 0.3" in text  # vLLM's CPU platform would otherwise reserve 92% of RAM
    command, _ = server_command(["--model=x", "--gpu-memory-utilization", "0.5", "--logprobs-mode", "raw_logprobs"])
    assert command.count("--gpu-memory-utilization") == 1 and "processed_logprobs" not in command  # the user's
    with pytest.raises(ConfigError, match="needs --model"):
        server_command(["--port", "8000"])


@pytest.mark.slow  # two commands, each a fresh interpreter
@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_asking_for_vllm_without_it_is_one_line_with_the_install_command(tmp_path):
    import subprocess
    import sys

    from support import ROOT

    for argv in (["train", "grpo", "--use_vllm", "true", "--output_dir", str(tmp_path / "o")],
                 ["vllm-serve", "--model", "x"]):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "tunebook.cli", *argv], cwd=ROOT, capture_output=True, text=True)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert any("needs vLLM" in line and "make vllm" in line for line in lines), done.stderr[-2000:]


def test_async_generation_with_the_transformers_backend_refuses_a_sharded_model():
    from types import SimpleNamespace

    from tunebook.errors import ConfigError
    from tunebook.rl.engines import make_backend

    model = _policy("linear")
    model.model.embed_tokens.weight.ds_id = 0  # what DeepSpeed ZeRO-3 marks its partitioned parameters with
    config = SimpleNamespace(use_vllm=False, async_generation=True)
    with pytest.raises(ConfigError, match="sharded model"):
        make_backend(config, model, SimpleNamespace(device="cpu"), SimpleNamespace(processor=None), None)


def test_stop_ids_whatever_stop_token_ids_answers_become_samplings_tuple():
    """One id, several (a list or a tuple) or none (a tokenizer without EOS): the tuple every backend reads."""
    assert stop_id_tuple(7) == (7,)
    assert stop_id_tuple([7, 9]) == (7, 9) and stop_id_tuple((7, 9)) == (7, 9)
    assert stop_id_tuple(None) == ()
