"""lm-evaluation-harness on our model (`tunebook.evaluation.harness`): its figures equal a direct computation of the
same accuracy (our own log-likelihoods, one example at a time on full logits; our own greedy generation), its prompts
are the chat template's, it leaves the process's random states as they were, and a task that is not one is one
line."""

from __future__ import annotations

import importlib.util
import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support import write_harness_tasks

if importlib.util.find_spec("lm_eval") is None:  # not importorskip: lm-eval is imported as tunebook imports it
    pytest.skip('lm-evaluation-harness is not installed: pip install "tunebook[eval]"', allow_module_level=True)

from tunebook.config.harness import harness_tasks  # noqa: E402
from tunebook.errors import ConfigError  # noqa: E402
from tunebook.evaluation.harness import harness_figures, run_harness  # noqa: E402


@pytest.fixture(scope="module")
def chat_model(tiny_chat_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir), AutoTokenizer.from_pretrained(
        tiny_chat_model_dir
    )


def _rendered(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip


@torch.no_grad()
def _direct_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) on one unpadded row's full logits (the context's trailing whitespace belongs to
    the continuation, as lm-eval splits them)."""
    kept = context.rstrip()
    whole = tokenizer.encode(context + continuation)
    start = len(tokenizer.encode(kept))
    logprobs = F.log_softmax(model(torch.tensor([whole])).logits[0].double(), dim=-1)
    return float(sum(logprobs[p - 1, whole[p]] for p in range(start, len(whole))))


@torch.no_grad()
def _direct_reply(model, tokenizer, context: str, max_new_tokens: int) -> str:
    """Greedy tokens one at a time until the end of turn (the tokenizer's EOS or the model's), then cut at the
    task's stop string."""
    ids = tokenizer.encode(context)
    stops = {tokenizer.eos_token_id, model.generation_config.eos_token_id}
    new = []
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
        if token in stops:
            break
        new.append(token)
    return tokenizer.decode(new, skip_special_tokens=True).split("\n\n")[0]


def test_harness_figures_equal_the_direct_computation_and_leave_the_random_states(chat_model, tmp_path):
    model, tokenizer = chat_model
    tasks = write_harness_tasks(tmp_path)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    model.train()  # as in a run's evaluation: eval mode while the harness runs, then training mode again
    # batch_size 7: batches of uneven lengths, and a last one that is short
    results = run_harness(model, tokenizer, [str(tasks["choice"]), str(tasks["reply"])], batch_size=7,
                          log_samples=True)  # fmt: skip
    assert model.training
    model.eval()
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
    assert "HF_XET_HIGH_PERFORMANCE" not in os.environ  # what importing lm-eval sets, taken back
    assert torch.equal(torch.get_rng_state(), before[2])
    figures = harness_figures(results)

    choice = results["samples"]["tiny_choice"]
    assert len(choice) == 50
    hits = []
    for sample in choice:
        contexts = {context for context, _ in sample["arguments"]}
        assert contexts == {_rendered(tokenizer, sample["doc"]["question"])}  # the chat template's prompt
        direct = [_direct_loglikelihood(model, tokenizer, c, cont) for c, cont in sample["arguments"]]
        harness = [ll for ll, _ in sample["filtered_resps"]]
        assert harness == pytest.approx(direct, abs=1e-4)
        hits.append(int(np.argmax(direct)) == sample["doc"]["answer"])
    assert figures["harness/tiny_choice/acc"] == pytest.approx(np.mean(hits), abs=1e-12)

    reply = results["samples"]["tiny_reply"]
    matches = []
    for sample in reply:
        context, settings = sample["arguments"][0]
        assert context == _rendered(tokenizer, sample["doc"]["question"])
        matches.append(_direct_reply(model, tokenizer, context, settings["max_gen_toks"]) == sample["doc"]["answer"])
    assert 0 < np.mean(matches) < 1  # the model answers some questions with the target and not others
    assert figures["harness/tiny_reply/exact_match"] == pytest.approx(np.mean(matches), abs=1e-12)


def test_plain_prompts_without_the_chat_template(chat_model, tmp_path):
    model, tokenizer = chat_model
    tasks = write_harness_tasks(tmp_path, rows=5)
    results = run_harness(model, tokenizer, [str(tasks["choice"])], chat_template=False, log_samples=True)
    assert [s["arguments"][0][0] for s in results["samples"]["tiny_choice"]] == ["hi", "what is it?", "hello",
                                                                                "two plus two", "hi there"]  # fmt: skip
    assert results["tunebook"]["chat_template"] is False


def test_a_task_that_is_not_one_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"^tasks: .*missing\.yaml: no such task YAML file$"):
        harness_tasks([str(tmp_path / "missing.yaml")], key="tasks")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is a directory with no lm-eval task YAML"):
        harness_tasks([str(tmp_path / "empty")])
    (tmp_path / "bad.yaml").write_text("dataset_path: json\n")
    with pytest.raises(ConfigError, match="names no task"):
        harness_tasks([str(tmp_path / "bad.yaml")])
    # lm-eval's registry, played by a directory of three tasks (its own index of ~15,000 files takes ~7 s to read)
    from tunebook.config import harness as harness_config

    registry = str(write_harness_tasks(tmp_path / "registry", rows=1)["choice"].parent)
    manager = harness_config.task_manager
    monkeypatch.setattr(harness_config, "task_manager", lambda paths, defaults: manager(paths or (registry,), False))
    assert harness_tasks(["tiny_reply"]).registry
    with pytest.raises(ConfigError, match=r"'tiny_replies' is neither .* registry\. Did you mean 'tiny_reply'\?$"):
        harness_tasks(["tiny_replies"])
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else find_spec(name))
    with pytest.raises(
        ConfigError, match=r'lm-evaluation-harness, which is not installed here: pip install "tunebook'
    ):
        harness_tasks(["arc_easy"])


def test_a_directory_of_tasks_is_all_of_them(tmp_path):
    tasks = write_harness_tasks(tmp_path / "tasks", rows=3)
    resolved = harness_tasks([str(tasks["choice"].parent)])
    assert sorted(resolved.specs) == ["tiny_choice", "tiny_reply", "tiny_rolling"] and not resolved.registry


def test_every_answer_is_lm_evals_own_hf_models(chat_model, tmp_path):
    """lm-eval's `hf` model (batch size 1, no padding) on the same model and tasks, through `simple_evaluate`: every
    request's answer (log-likelihoods to float32 rounding, greedy flags, generated text) and every figure equal ours.
    max_length 16 cuts contexts from the left, windows the rolling texts and leaves 8 tokens of context to generate
    from; plain prompts (lm-eval's default)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = chat_model
    names = [str(p) for p in write_harness_tasks(tmp_path, rows=20).values()]
    resolved = harness_tasks(names)
    reference = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, max_length=16,
                                           device="cpu"), tasks=list(resolved.specs), task_manager=resolved.manager(),
                                bootstrap_iters=0, log_samples=True)  # fmt: skip
    ours = run_harness(model, tokenizer, names, batch_size=7, max_length=16, chat_template=False, log_samples=True)
    for task in ("tiny_choice", "tiny_reply", "tiny_rolling"):
        for theirs, mine in zip(reference["samples"][task], ours["samples"][task], strict=True):
            assert theirs["arguments"] == mine["arguments"]
            for a, b in zip(theirs["resps"], mine["resps"], strict=True):
                if isinstance(a[0], str):  # generated text
                    assert a == b
                elif isinstance(a[0], tuple):  # (log-likelihood, greedy)
                    assert a[0][0] == pytest.approx(b[0][0], rel=1e-5, abs=1e-4) and a[0][1] == b[0][1]
                else:  # a rolling text's log-likelihood
                    assert a[0] == pytest.approx(b[0], rel=1e-5, abs=1e-4)
    assert harness_figures(ours) == pytest.approx(harness_figures(reference), rel=1e-6)


def test_what_does_not_fit_the_model_is_one_line(chat_model, tmp_path):
    from tunebook.errors import DataError

    model, tokenizer = chat_model
    tasks = write_harness_tasks(tmp_path, rows=3)
    with pytest.raises(DataError, match=r"^lm-eval task: the continuation .* tokens, which do not fit the model's "):
        run_harness(model, tokenizer, [str(tasks["choice"])], max_length=2)
    with pytest.raises(ConfigError, match=r"^lm-eval task: max_gen_toks 8 leaves no room for a prompt"):
        run_harness(model, tokenizer, [str(tasks["reply"])], max_length=8)
