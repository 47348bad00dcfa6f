"""The reward model's pieces against direct computations: the Bradley-Terry loss, rewards read from one padded forward
of a pair batch, margins carried from the data, and a saved model as a scoring function (`load_reward_model`)."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tunebook.data.collate import PairCollator
from tunebook.errors import ModelError
from tunebook.models import build_sequence_classifier
from tunebook.preference import bradley_terry_loss, load_reward_model, pair_rewards
from tunebook.preference.data import tokenize_pairs
from tunebook.rl.rewards import load_reward_functions

PAIRS = {
    "prompt": ["Reverse the digits.\n1234", [{"role": "user", "content": "Sort the digits in ascending order.\n391"}],
               "Reverse the digits.\n98765"],
    "chosen": ["4321", [{"role": "assistant", "content": "139"}], "56789"],
    "rejected": ["1234", "193", "5678"],
    "margin": [0.0, 1.5, -0.25],
}  # fmt: skip


def test_bradley_terry_loss_is_the_formula():
    rewards = torch.tensor([1.0, -0.5, 2.0, 0.25, 0.5, 3.0], dtype=torch.float64, requires_grad=True)
    margin = torch.tensor([0.0, 1.0, -2.0])
    losses, chosen, rejected = bradley_terry_loss(rewards, margin)
    expected = [
        math.log(1 + math.exp(-(c - r - m))) for c, r, m in ((1.0, 0.25, 0.0), (-0.5, 0.5, 1.0), (2.0, 3.0, -2.0))
    ]
    assert losses.tolist() == pytest.approx(expected, rel=1e-12)
    assert chosen.tolist() == [1.0, -0.5, 2.0] and rejected.tolist() == [0.25, 0.5, 3.0] and not chosen.requires_grad
    losses.sum().backward()  # d loss / d r_chosen = -(1 - sigmoid(d)), d loss / d r_rejected the opposite
    d = torch.tensor([0.75, -2.0, 1.0], dtype=torch.float64)  # r_chosen - r_rejected - margin
    assert rewards.grad.tolist() == pytest.approx(torch.cat([torch.sigmoid(d) - 1, 1 - torch.sigmoid(d)]).tolist())
    no_margin = torch.tensor([0.75, -1.0, -1.0], dtype=torch.float64)
    assert bradley_terry_loss(rewards.detach())[0].tolist() == pytest.approx((-F.logsigmoid(no_margin)).tolist())


def _classifier(tokenizer, model_config):
    torch.manual_seed(0)
    model = build_sequence_classifier(tokenizer, ["reward"], problem_type="regression", model_config=model_config)
    return model.eval()


def test_pair_rewards_are_each_sequence_scored_alone_and_margins_come_along(tiny_tokenizer, tiny_model_config):
    tokenized = tokenize_pairs(PAIRS, [0, 1, 2], tokenizer=tiny_tokenizer, max_seq_length=64, overlong="truncate",
                               where="test")  # fmt: skip
    assert tokenized["margin"] == [0.0, 1.5, -0.25]
    rows = [{k: tokenized[k][i] for k in tokenized} for i in range(3)]
    batch = PairCollator(tiny_tokenizer.pad_token_id, 8)(rows)
    assert batch["input_ids"].shape[0] == 6 and batch["margin"].tolist() == [0.0, 1.5, -0.25]
    model = _classifier(tiny_tokenizer, tiny_model_config)
    with torch.no_grad():
        rewards = pair_rewards(model, batch)
        alone = [model(input_ids=torch.tensor([ids])).logits[0, 0].item()
                 for ids in tokenized["chosen_input_ids"] + tokenized["rejected_input_ids"]]  # fmt: skip
    assert rewards.tolist() == pytest.approx(alone, abs=1e-5)  # padding changes nothing: the last real token's score


def test_a_saved_reward_model_scores_prompts_and_completions_as_training_formats_them(
    tiny_tokenizer, tiny_model_config, tmp_path
):
    model = _classifier(tiny_tokenizer, tiny_model_config)
    model.save_pretrained(tmp_path / "rm")
    tiny_tokenizer.save_pretrained(tmp_path / "rm")
    tokenized = tokenize_pairs(PAIRS, [0, 1, 2], tokenizer=tiny_tokenizer, max_seq_length=64, overlong="truncate",
                               where="test")  # fmt: skip
    with torch.no_grad():
        expected = pair_rewards(model, PairCollator(tiny_tokenizer.pad_token_id)(
            [{k: tokenized[k][i] for k in tokenized} for i in range(3)]
        )).tolist()  # fmt: skip
    score = load_reward_model(tmp_path / "rm", batch_size=2)
    assert score.__name__ == "reward_model"
    prompts = PAIRS["prompt"] * 2
    completions = PAIRS["chosen"] + PAIRS["rejected"]
    assert score(prompts, completions) == pytest.approx(expected, abs=1e-5)
    # The same conversation in the other shapes: a message-list prompt, a whole conversation as the completion.
    as_messages = [{"role": "user", "content": "Reverse the digits.\n1234"}]
    whole = [*as_messages, {"role": "assistant", "content": "4321"}]
    assert score([as_messages, as_messages], ["4321", whole], extra_column=[1, 2]) == pytest.approx(
        [expected[0]] * 2, abs=1e-5
    )
    # max_length cuts the response as training cut pairs: the prompt whole, the response's end dropped.
    ids = tokenized["chosen_input_ids"][0]
    with torch.no_grad():
        expected_cut = model(input_ids=torch.tensor([ids[:-2]])).logits[0, 0].item()
    cut = load_reward_model(tmp_path / "rm", max_length=len(ids) - 2)
    assert cut(prompts[:1], ["4321"]) == pytest.approx([expected_cut], abs=1e-5)


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_a_reward_model_next_to_reward_functions_under_group_scaling_is_warned_of(
    tiny_tokenizer, tiny_model_config, tmp_path, caplog, scale
):
    _classifier(tiny_tokenizer, tiny_model_config).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    config = SimpleNamespace(reward_functions=["exact_match"], reward_model=str(tmp_path), reward_weights=None,
                             scale_rewards=scale, reference_column="answer", use_safetensors=True,
                             trust_remote_code=False)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="tunebook"):
        functions = load_reward_functions(config)
    assert [f.name for f in functions] == ["exact_match", "reward_model"]
    assert ("scale_rewards: batch keeps it at its weight" in caplog.text) == (scale == "group")


def test_a_classifier_with_several_outputs_is_not_a_reward_model(tiny_tokenizer, tiny_model_config, tmp_path):
    build_sequence_classifier(tiny_tokenizer, ["a", "b"], model_config=tiny_model_config).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="a reward model has one output; this one has 2 labels"):
        load_reward_model(tmp_path)


def test_a_reward_model_with_only_pickled_weights_is_refused_unless_allowed(
    tiny_tokenizer, tiny_model_config, tmp_path
):
    """The reward model loads under the same guard as the policy: pickled weights (which run code when unpickled)
    only with use_safetensors: false."""
    model = _classifier(tiny_tokenizer, tiny_model_config)
    model.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()  # transformers 5 writes safetensors only: pickle the weights by hand
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    assert (tmp_path / "pytorch_model.bin").is_file() and not list(tmp_path.glob("*.safetensors"))
    with pytest.raises(ModelError, match="has only pickled .bin weights, which can run code when loaded"):
        load_reward_model(tmp_path)
    config = SimpleNamespace(reward_functions=[], reward_model=str(tmp_path), reward_weights=None, scale_rewards="group",
                             reference_column="answer", use_safetensors=True, trust_remote_code=False)  # fmt: skip
    with pytest.raises(ModelError, match="has only pickled .bin weights"):
        load_reward_functions(config)
    config.use_safetensors = False
    (reward,) = load_reward_functions(config)
    assert len(reward.fn(["Reverse the digits.\n12"], ["21"])) == 1
