"""One stop-token rule and one exact-match rule for every generation evaluation (SFT's and GRPO's
`eval_exact_match`, GRPO's rollouts and `exact_match` reward), and the one evaluation scaffold."""

from __future__ import annotations

import logging

import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset
from transformers import GenerationConfig

from tunebook.evaluation import generation_exact_match, log_samples
from tunebook.evaluation.batches import gathered_batches
from tunebook.evaluation.generate import stop_token_ids
from tunebook.evaluation.scores import exact_match, exact_matches
from tunebook.models import build_causal_lm
from tunebook.rl import grpo, rewards


def test_stop_tokens_are_the_tokenizers_eos_then_the_generation_configs(tiny_tokenizer, tiny_model_config):
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config)
    eos = tiny_tokenizer.eos_token_id
    assert stop_token_ids(model, tiny_tokenizer) == eos  # as built: one id, given as an int (what generate got before)
    model.generation_config = GenerationConfig(eos_token_id=[7, eos, 9])  # e.g. Llama 3 Instruct's three
    assert stop_token_ids(model, tiny_tokenizer) == [eos, 7, 9]
    model.generation_config = GenerationConfig(eos_token_id=None)
    assert stop_token_ids(model, tiny_tokenizer) == eos
    assert grpo.stop_tokens is stop_token_ids  # GRPO's rollouts and evaluation stop by the same rule


def test_sfts_generation_eval_stops_on_every_eos_id_of_the_model(tiny_tokenizer, tiny_model_config):
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config)
    model.generation_config = GenerationConfig(eos_token_id=[tiny_tokenizer.eos_token_id, 7])
    seen, generate = [], model.generate

    def spy(*args, **kwargs):
        seen.append(kwargs["eos_token_id"])
        return generate(*args, **kwargs)

    model.generate = spy
    ids = tiny_tokenizer("0123 four", add_special_tokens=False)["input_ids"]
    dataset = Dataset.from_dict(
        {"input_ids": [ids] * 3, "labels": [[-100] * 2 + ids[2:]] * 3, "prompt_length": [2] * 3}
    )
    model.train()
    metrics, samples = generation_exact_match(model, tiny_tokenizer, dataset, Accelerator(cpu=True), batch_size=2,
                                              max_new_tokens=3)  # fmt: skip
    assert seen == [[tiny_tokenizer.eos_token_id, 7]] * 2  # two batches; before: the tokenizer's EOS alone
    assert 0.0 <= metrics["eval_exact_match"] <= 1.0 and len(samples) == 3
    assert model.training  # restored


def test_one_exact_match_rule_for_the_metric_the_reward_and_the_eval():
    predictions, references = [" 42\n", "abc", "X", "7"], ["42", " abd", "x", 7]
    assert exact_matches(predictions, [str(r) for r in references]) == [1.0, 0.0, 0.0, 1.0]
    assert rewards.exact_match(None, predictions, reference=references) == [1.0, 0.0, 0.0, 1.0]
    assert exact_match(predictions[:3], references[:3]) == 1 / 3
    assert exact_matches(["X"], ["x"], ignore_case=True) == [1.0]
    with pytest.raises(ValueError):  # a missing reference is an error, not a silently shorter mean
        exact_matches(["a", "b"], ["a"])


def test_the_scaffold_evaluates_without_gradients_in_eval_mode_and_restores_the_mode(tiny_tokenizer):
    model = torch.nn.Dropout(0.5).train()
    modes = []

    def compute(batch):
        modes.append((model.training, torch.is_grad_enabled()))
        return batch * 2

    loader = torch.utils.data.DataLoader(torch.arange(5.0), batch_size=2)
    got = torch.cat(list(gathered_batches(model, loader, Accelerator(cpu=True), compute)))
    assert got.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert modes == [(False, False)] * 3 and model.training

    def fails(batch):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        list(gathered_batches(model, loader, Accelerator(cpu=True), fails))
    assert model.training  # restored on an error too


def test_samples_of_the_untrained_model_are_labelled_before_training(caplog):
    log = logging.getLogger("tunebook")
    samples = [{"prediction": "\ufffd\ufffd", "reference": "2334"}]
    with caplog.at_level(logging.INFO, logger="tunebook"):
        log_samples(log, samples, 0)
        log_samples(log, [{"prediction": "2334", "reference": "2334"}], 500)
    assert [r.getMessage() for r in caplog.records] == [
        "  before training: generated '\ufffd\ufffd', reference '2334'",  # not passed off as what training made
        "  step 500: generated '2334', reference '2334'",
    ]
