"""`tunebook.rl.rollouts.RolloutSource`: synchronous generation samples the current weights; async generation
samples the next window from the weights one step behind, exactly, and the importance weights then correct it."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from rl_policies import policy as _policy

from tunebook.rl.generation import Sampling, TransformersBackend
from tunebook.rl.grpo import completion_seed
from tunebook.rl.rewards import RewardFunction
from tunebook.rl.rollouts import PendingRollouts, RolloutSource
from tunebook.rl.stats import GRPOStats

G = 4
STOPS = (1, 2)  # the test tokenizer's EOS, then the tiny Llama's generation config's


class _Accelerator:
    device, num_processes, process_index, is_main_process = torch.device("cpu"), 1, 0, True

    def gather(self, t):
        return t

    def wait_for_everyone(self):
        pass


def _config(**keys):
    settings = {"num_generations": G, "max_new_tokens": 5, "temperature": 1.0, "top_p": 1.0, "seed": 3,
                "num_iterations": 1, "beta": 0.0, "scale_rewards": "group", "async_generation": False,
                "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate",
                "vllm_importance_sampling_clip_min": None, "vllm_importance_sampling_clip_max": 3.0}  # fmt: skip
    return SimpleNamespace(**{**settings, **keys})


def _source(model, **keys):
    config = _config(**keys)
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1, batch_decode=lambda ids, **_: [str(i) for i in ids])
    data = SimpleNamespace(tokenizer=tokenizer, processor=None)
    rewards = [RewardFunction("length", lambda prompts, completions, **_: [len(c) for c in completions], 1.0)]
    backend = TransformersBackend(model, "cpu", snapshot=config.async_generation)
    figures = GRPOStats("cpu", ["length"])
    return RolloutSource(config, _Accelerator(), backend, model, None, rewards, figures, data, PendingRollouts(), 0)


def _window(rows):
    prompts = {0: [5, 9, 11, 3], 1: [7, 2], 2: [4, 4, 8], 3: [6, 3, 3]}
    return [{"prompt": [str(r) for r in rows], "prompt_ids": [prompts[r] for r in rows], "row": torch.tensor(rows)}]


def _train(model):
    with torch.no_grad():  # an optimizer step, as far as sampling can tell
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))


def _completions(model, rows, step):
    """What `model`'s own generate samples for `rows` at `step` (their seeds), stopping where the source does (the
    tokenizer's EOS and the generation config's)."""
    backend = TransformersBackend(model, "cpu")
    prompts = [p for p in _window(rows)[0]["prompt_ids"] for _ in range(G)]
    seeds = [completion_seed(3, step, r, g) for r in rows for g in range(G)]
    return backend.generate(prompts, seeds, Sampling(5, stop_token_ids=STOPS, pad_token_id=0)).token_ids


def _tokens(rollouts):
    return [[t for t in row if t != -100] for row in rollouts[0].labels.tolist()]


def test_synchronous_generation_samples_the_current_weights():
    model = _policy("linear")
    source = _source(model)
    assert source.sampling.stop_token_ids == STOPS
    windows = list(source.windows([_window([0, 1]), _window([2, 3])]))
    assert [u for _, u in windows] == [None, None]
    _, first = source.next(windows[0][0], None, 0)
    assert _tokens(first) == _completions(model, [0, 1], 0)
    _train(model)
    _, second = source.next(windows[1][0], None, 1)
    assert _tokens(second) == _completions(model, [2, 3], 1)


def test_async_generation_samples_the_next_window_one_step_behind():
    model = _policy("linear")
    source = _source(model, async_generation=True)
    windows = list(source.windows([_window([0, 1]), _window([2, 3]), _window([0, 2])]))
    assert [u is not None for _, u in windows] == [True, True, False]
    _, first = source.next(*windows[0], 0)  # sampled now; the next window starts sampling from theta_0
    theta_0 = _policy("linear")
    _train(model)  # step 0 -> theta_1
    _, second = source.next(*windows[1], 1)
    assert _tokens(second) == _completions(theta_0, [2, 3], 1)  # theta_0's, at step 1's seeds
    assert _tokens(second) != _completions(model, [2, 3], 1)
    theta_1 = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model)  # -> theta_2
    _, third = source.next(*windows[2], 2)
    old = _policy("linear")
    old.load_state_dict(theta_1)
    assert _tokens(third) == _completions(old, [0, 2], 2)  # one step behind again, never two
    source.close()
    # its log-probs are theta_1's, the trainer's now are theta_2's: the weights correct for the difference
    from tunebook.rl.grpo import completion_log_probs

    with torch.no_grad():
        trainer, rows = completion_log_probs(model, third[0], 1.0)
        sampler_then, _ = completion_log_probs(old, third[0], 1.0)
    torch.testing.assert_close(third[0].sampler_log_probs, sampler_then, atol=1e-5, rtol=0)
    weights = source.weights(third[0], trainer, rows, first_update=True)
    expected = torch.exp(trainer - third[0].sampler_log_probs).clamp(max=3.0)
    torch.testing.assert_close(weights, expected)
    assert (weights - 1).abs().max() > 1e-3  # not on-policy
    source.figures.add(steps=1, loss=0.0, trained_tokens=1)
    assert "sampling/kl" in source.figures.pop(SimpleNamespace(num_processes=1, gather=lambda t: t))


def test_the_trainers_own_sampling_is_not_corrected_but_its_mismatch_is_measured():
    model = _policy("linear")
    source = _source(model)
    _, rollouts = source.next(_window([0, 1])[0:1], None, 0)
    from tunebook.rl.grpo import completion_log_probs

    with torch.no_grad():
        trainer, rows = completion_log_probs(model, rollouts[0], 1.0)
    assert source.weights(rollouts[0], trainer, rows, first_update=True) is None
    source.figures.add(steps=1, loss=0.0, trained_tokens=1)
    figures = source.figures.pop(SimpleNamespace(num_processes=1, gather=lambda t: t))
    assert figures["sampling/sampling_logp_difference/max"] < 1e-4  # generate's KV cache vs one forward, float32


def test_overlapping_eager_sections_in_two_threads_leave_compilation_on():
    """Async generation's thread and the main thread's evaluation both decode eagerly: however their sections
    interleave, the process is not left forced eager (a compiled function compiles afterwards)."""
    import threading

    from tunebook import compat
    from tunebook.training.compilation import eager

    entered, release = threading.Event(), threading.Event()

    def other():
        with eager():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with eager():  # main enters first, the thread second; main leaves first, the thread last
        thread.start()
        entered.wait(10)
    release.set()
    thread.join()
    start, _ = compat.compiled_frames()
    torch.compile(lambda x: x * 3, backend="eager")(torch.ones(2))
    assert compat.compiled_frames()[0] == start + 1
