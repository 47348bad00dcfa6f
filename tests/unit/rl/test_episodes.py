"""Multi-turn episodes (`tunebook.rl.episodes`): what the sequence holds, which tokens carry loss, the limits, tool
errors as observations, determinism, and log-probs of the model's tokens against a plain forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tunebook.data.tokenize import IGNORE_INDEX, render_chat
from tunebook.errors import ConfigError
from tunebook.rl.environments import Environment, ToolEnvironment, load_tools
from tunebook.rl.episodes import run_episodes, turn_seed
from tunebook.rl.generation import Generated, GenerationBackend, Sampling, TransformersBackend
from tunebook.rl.grpo import Rollouts, completion_log_probs, rollout_rows
from tunebook.rl.tool_calls import ToolCallFormat

CALCULATOR = Path(__file__).parents[3] / "recipes" / "configs" / "grpo" / "calculator_tools.py"
ROWS = [{"prompt": "Multiply.\n123*456", "answer": "56088"}, {"prompt": "Multiply.\n200*300", "answer": "60000"}]


def _call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class Scripted(GenerationBackend):
    """Every episode's turn k is `turns[k]` (then the last), ending in the stop token: the model's side scripted."""

    def __init__(self, tokenizer, turns: list[str]):
        stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.turns = [tokenizer(t, add_special_tokens=False)["input_ids"] + [stop] for t in turns]
        self.calls, self.prompts = 0, []

    def generate(self, prompt_ids, seeds, sampling, images=None):
        self.prompts.append(prompt_ids)
        turn = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        out = [turn[: sampling.max_new_tokens] for _ in prompt_ids]
        return Generated(out, [[-0.5 - j for j in range(len(o))] for o in out])


def _tool_env():
    return ToolEnvironment(load_tools([f"{CALCULATOR}:calculator"]))


def _run(tokenizer, backend, environment=None, rows=ROWS, seeds=(1, 2), iterations=None, budget=400, new=120):
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampling = Sampling(max_new_tokens=new, stop_token_ids=(stop,), pad_token_id=tokenizer.pad_token_id)
    return run_episodes(backend, environment or _tool_env(), list(rows), list(seeds), sampling, tokenizer,
                        ToolCallFormat.from_template(tokenizer), max_tool_calling_iterations=iterations,
                        max_episode_tokens=budget)  # fmt: skip


def test_an_episode_is_the_models_turns_with_the_tools_results_between_them(tiny_tokenizer):
    """call -> the calculator's result as a tool message -> answer: the sequence is the prompt (with the tool's
    definition) + turn 1 + the template's tool turn and generation prompt + turn 2, and it is exactly what the chat
    template renders for the episode's messages; the loss mask is 1 on the model's tokens only, the engine's
    log-probs are those of the model's tokens, in order."""
    tok = tiny_tokenizer
    backend = Scripted(tok, [_call("calculator", {"expression": "123*456"}), "56088"])
    ep = _run(tok, backend, rows=ROWS[:1], seeds=[7])
    messages = ep.messages[0]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[2]["content"] == "56088" and messages[3]["content"] == "56088" and ep.texts == ["56088"]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "123*456"}}
    tools = _tool_env().tools
    rendered = render_chat(tok, messages, tools)
    assert tok.decode(ep.prompt_ids[0] + ep.token_ids[0]) == rendered.removesuffix("\n")  # the last stop token ends it
    turn1, turn2 = backend.turns
    assert ep.token_ids[0][: len(turn1)] == turn1 and ep.token_ids[0][-len(turn2) :] == turn2  # kept, not re-tokenised
    environment = len(ep.token_ids[0]) - len(turn1) - len(turn2)
    assert ep.loss_mask[0] == [1] * len(turn1) + [0] * environment + [1] * len(turn2)
    assert ep.log_probs[0] == [-0.5 - j for j in range(len(turn1))] + [-0.5 - j for j in range(len(turn2))]
    assert ep.model_lengths() == [len(turn1) + len(turn2)]
    assert (ep.turns, ep.tool_calls, ep.tool_failures, ep.truncated) == ([2], [1], [0], [False])
    # the second turn was generated from the whole episode so far
    assert backend.prompts[1] == [ep.prompt_ids[0] + ep.token_ids[0][: len(turn1) + environment]]


def test_tool_errors_unknown_tools_and_unparsable_calls_come_back_as_tool_messages(tiny_tokenizer):
    turn = _call("calculator", {"expression": "1/0"}) + _call("abacus", {}) + "<tool_call>\n{oops\n</tool_call>"
    ep = _run(tiny_tokenizer, Scripted(tiny_tokenizer, [turn, "0"]), rows=ROWS[:1], seeds=[7], new=300, budget=600)
    results = [m["content"] for m in ep.messages[0] if m["role"] == "tool"]
    assert results[0] == "error: ZeroDivisionError: division by zero"
    assert results[1] == "error: unknown tool 'abacus'; the tools are calculator"
    assert results[2].startswith("error: the tool call is not valid JSON")
    assert (ep.tool_calls, ep.tool_failures, ep.turns, ep.texts) == ([3], [3], [2], ["0"])


def test_the_turn_limit_and_the_token_budget_end_episodes(tiny_tokenizer):
    tok = tiny_tokenizer
    always = [_call("calculator", {"expression": "2*3"})]
    limited = _run(tok, Scripted(tok, always), iterations=1)
    assert limited.turns == [2, 2] and limited.truncated == [True, True] and limited.tool_calls == [2, 2]
    assert limited.loss_mask[0][-1] == 1  # it ends with the model's turn: no tool result it cannot answer
    turn = len(Scripted(tok, always).turns[0])
    unlimited = _run(tok, Scripted(tok, always), iterations=None, budget=3 * turn)  # no turn limit: the budget's
    assert unlimited.truncated == [True, True] and unlimited.turns == [3, 3]
    assert len(unlimited.token_ids[0]) == 3 * turn  # the third turn generated what was left, no more
    third = turn - unlimited.loss_mask[0].count(0)  # what two rounds of tool results left of the third turn
    assert 0 < third < turn and unlimited.loss_mask[0][-third:] == [1] * third
    cut = _run(tok, Scripted(tok, always), budget=10)  # the first turn is cut at the budget mid-call
    assert [len(t) for t in cut.token_ids] == [10, 10] and cut.truncated == [True, True] and cut.turns == [1, 1]
    assert cut.loss_mask == [[1] * 10] * 2


class Echo(Environment):
    """Answers every turn with a tool message until the third turn: multi-turn episodes from any model."""

    def step(self, messages):
        turns = sum(m["role"] == "assistant" for m in messages)
        return [{"role": "tool", "name": "echo", "content": f"turn {turns} seen"}], float(turns), turns >= 3


def _model(vocab: int):
    from support import TINY_TEST_MODEL
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    settings = {k: v for k, v in TINY_TEST_MODEL.items() if k != "model_type"}
    model = LlamaForCausalLM(LlamaConfig(**settings, vocab_size=vocab))
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)  # logits of a few units: distinct tokens per seed
    return model.eval()


def _sampled(tok, model, rows, seeds):
    """Episodes of a real (random) policy; a third of the vocabulary stops a turn, so turns end early and often."""
    stops = tuple(range(4, len(tok), 3))
    sampling = Sampling(max_new_tokens=6, temperature=1.0, stop_token_ids=stops, pad_token_id=tok.pad_token_id)
    return run_episodes(TransformersBackend(model, "cpu"), Echo(), rows, seeds, sampling, tok,
                        ToolCallFormat.from_template(tok), max_tool_calling_iterations=None,
                        max_episode_tokens=64)  # fmt: skip


def test_episodes_are_deterministic_per_seed_whatever_shares_their_batch(tiny_tokenizer):
    """Same seeds, same episodes; an episode run alone equals it in a batch; turn 0 samples with the completion's
    own seed (a one-turn episode is the single-turn completion)."""
    model = _model(len(tiny_tokenizer))
    batch = _sampled(tiny_tokenizer, model, ROWS * 2, [11, 12, 13, 14])
    again = _sampled(tiny_tokenizer, model, ROWS * 2, [11, 12, 13, 14])
    alone = _sampled(tiny_tokenizer, model, ROWS[1:2], [14])
    assert batch.token_ids == again.token_ids and batch.log_probs == again.log_probs
    assert alone.token_ids[0] == batch.token_ids[3] and alone.loss_mask[0] == batch.loss_mask[3]
    assert len(set(map(tuple, batch.token_ids))) == 4  # the seeds differ, so do the episodes
    assert max(batch.turns) > 1  # Echo's reward k after turn k; a turn cut short gets none
    assert batch.rewards == [float(sum(range(1, t + (not cut)))) for t, cut in zip(batch.turns, batch.truncated)]
    assert turn_seed(5, 0) == 5 and len({turn_seed(5, t) for t in range(4)}) == 4


def test_environment_tokens_carry_no_loss_and_the_model_tokens_log_probs_are_a_plain_forwards(tiny_tokenizer):
    """The rollout rows of multi-turn episodes: labels only on the model's tokens; the trainer's log-probs there
    equal log_softmax of one plain forward of the whole sequence, and the engine's (recorded during generation,
    turn by turn) equal them too. float32: a few ulps of the largest logit per term of the dot products."""
    tok, temperature = tiny_tokenizer, 1.0
    model = _model(len(tok))
    ep = _sampled(tok, model, ROWS * 2, [21, 22, 23, 24])
    assert max(ep.turns) > 1 and any(0 in mask for mask in ep.loss_mask)
    rows = rollout_rows(ep.prompt_ids, ep.token_ids, tok.pad_token_id, "cpu", ep.loss_mask)
    r = Rollouts(*rows, torch.zeros(4), None, None)
    for i in range(4):
        labels = r.labels[i, len(ep.prompt_ids[i]) : len(ep.prompt_ids[i]) + len(ep.token_ids[i])].tolist()
        assert labels == [t if m else IGNORE_INDEX for t, m in zip(ep.token_ids[i], ep.loss_mask[i])]
    assert r.completion_lengths.tolist() == ep.model_lengths()
    with torch.no_grad():
        trainer, row_of = completion_log_probs(model, r, temperature)
        expected, top = [], 0.0
        for i in range(4):
            sequence = ep.prompt_ids[i] + ep.token_ids[i]
            logits = model(torch.tensor([sequence])).logits[0].float() / temperature
            top = max(top, float(logits.abs().max()))
            log_probs = logits.log_softmax(-1)
            start = len(ep.prompt_ids[i])
            expected += [float(log_probs[start + j - 1, t]) for j, (t, m) in
                         enumerate(zip(ep.token_ids[i], ep.loss_mask[i])) if m]  # fmt: skip
    tolerance = 4 * 64 * torch.finfo(torch.float32).eps * (top + 1)
    torch.testing.assert_close(trainer, torch.tensor(expected), atol=tolerance, rtol=0)
    engine = torch.tensor([x for row in ep.log_probs for x in row])
    assert len(engine) == len(trainer) and row_of.tolist() == [
        i for i in range(4) for _ in range(ep.model_lengths()[i])
    ]
    # generation's forward runs with a KV cache and left padding: other kernels, the same bound with room
    torch.testing.assert_close(engine, trainer, atol=tolerance * 10, rtol=0)


@pytest.mark.parametrize(
    "write, spec, message",
    [
        (None, "missing.py:f", "tool 'missing.py:f': file not found: missing.py"),
        ("def g(x: int) -> int:\n    '''G.\n\n    Args:\n        x: x.\n    '''\n    return x\n", "{file}:f",
         "defines no function 'f'"),
        ("def f(x):\n    return x\n", "{file}:f", "tool 'f': .*docstring"),
        ("def f(x: int) -> int:\n    '''F.'''\n    return x\n", "{file}:f", "tool 'f': .*Args"),
        (None, "calculator", "tool 'calculator': expected path/to/file.py:function_name"),
    ],
)  # fmt: skip
def test_bad_tools_are_one_line_config_errors(tmp_path, write, spec, message):
    file = tmp_path / "tools.py"
    if write:
        file.write_text(write)
    with pytest.raises(ConfigError, match=message) as error:
        load_tools([spec.format(file=file)])
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"tools": ["no_such_tools.py:calculator"]}, "tool 'no_such_tools.py:calculator': file not found: no_such_tools.py"),
        ({"tools": [f"{CALCULATOR}:abacus"]}, "defines no function 'abacus'"),
        ({"tools": ["calculator"]}, "tool 'calculator': expected path/to/file.py:function_name"),
        ({"tools": [f"{CALCULATOR}:calculator"] * 2}, "two tools are named 'calculator'"),
        ({"tools": [f"{CALCULATOR}:calculator"], "max_tool_calling_iterations": -1}, "max_tool_calling_iterations"),
        ({"tools": [f"{CALCULATOR}:calculator"], "max_episode_tokens": 0}, "max_episode_tokens"),
        ({"max_episode_tokens": 64}, "max_episode_tokens bounds multi-turn episodes, which need tools"),
        ({"synthetic_task": "division"}, "synthetic_task"),
    ],
)  # fmt: skip
def test_bad_tool_keys_are_one_line_config_errors(overrides, message):
    from tunebook.config import GRPOConfig, parse_config

    with pytest.raises(ConfigError, match=message) as error:
        parse_config(GRPOConfig, overrides=overrides, overrides_from="the test")
    assert "\n" not in str(error.value)


def test_the_episode_budget_defaults_to_max_new_tokens_and_counts_for_dr_grpo():
    from tunebook.config import GRPOConfig

    assert GRPOConfig(max_new_tokens=20).episode_tokens() == 20
    assert GRPOConfig(max_new_tokens=20, tools=[f"{CALCULATOR}:calculator"]).episode_tokens() == 20
    assert GRPOConfig(max_new_tokens=20, max_episode_tokens=90, tools=["x.py:f"]).episode_tokens() == 90


def test_an_environment_from_a_users_file_runs_the_episodes(tmp_path, tiny_tokenizer):
    from tunebook.config import GRPOConfig, parse_config
    from tunebook.rl.episodes import load_episodes

    file = tmp_path / "env.py"
    file.write_text(
        "from tunebook.rl.environments import Environment\n\n"
        "class Judge(Environment):\n"
        "    def step(self, messages):\n"
        "        return [], 0.5, True\n\n"
        "def make():\n    return Judge()\n\n"
        "def broken():\n    raise RuntimeError('no judge today')\n\n"
        "def wrong():\n    return 3\n"
    )
    config = parse_config(GRPOConfig, overrides={"environment": f"{file}:make"}, overrides_from="the test")
    runner = load_episodes(config, tiny_tokenizer, tiny_tokenizer.eos_token_id)
    ep = runner.run(Scripted(tiny_tokenizer, ["56088"]), {"prompt": [ROWS[0]["prompt"]]}, 2, [1, 2])
    assert ep.rewards == [0.5, 0.5] and ep.texts == ["56088", "56088"] and runner.tools is None
    for name, message in [("broken", "calling it raised RuntimeError: no judge today"), ("wrong", "returned a int")]:
        config = parse_config(GRPOConfig, overrides={"environment": f"{file}:{name}"}, overrides_from="the test")
        with pytest.raises(ConfigError, match=message):
            load_episodes(config, tiny_tokenizer, tiny_tokenizer.eos_token_id)
    with pytest.raises(ConfigError, match="environment and tools: give one"):
        parse_config(GRPOConfig, overrides={"environment": f"{file}:make", "tools": [f"{CALCULATOR}:calculator"]},
                     overrides_from="the test")  # fmt: skip


def test_episode_figures_are_logged_per_episode_and_per_call(tiny_tokenizer):
    """tools/call_frequency (TRL's: calls per episode), tools/failure_frequency (TRL's: errors per call), the rate of
    episodes with a call, turns and truncated episodes; none of them without episodes."""
    from accelerate import Accelerator

    from tunebook.rl.stats import GRPOStats

    turn = _call("calculator", {"expression": "1/0"}) + _call("calculator", {"expression": "2*3"})
    ep = _run(tiny_tokenizer, Scripted(tiny_tokenizer, [turn, "6"]), rows=ROWS[:1], seeds=[1], new=300, budget=600)
    plain = GRPOStats("cpu", ["exact_match"])
    plain.add(steps=1, completions=2)
    assert not any(k.startswith(("tools/", "episodes/")) for k in plain.pop(Accelerator(cpu=True)))
    figures = GRPOStats("cpu", ["exact_match"])
    figures.add(steps=1, completions=2, **ep.stats())
    figures.add(**{**ep.stats(), "tool_calls": 0, "episodes_with_calls": 0, "tool_failures": 0, "truncated": 1})
    logged = figures.pop(Accelerator(cpu=True))
    assert logged["tools/call_frequency"] == 1.0 and logged["tools/call_rate"] == 0.5
    assert logged["tools/failure_frequency"] == 0.5 and logged["episodes/turns"] == 2.0
    assert logged["episodes/truncated"] == 0.5
