"""KTO against TRL's code and the paper's formula: the loss, rewards and KL reference point on a tiny model's
log-probabilities (TRL's `KTOTrainer._compute_loss` transcribed below), the reference point independent of how a step
is split into micro-batches, and the data: TRL's unpaired rows, pairs split into rows, labels that are not booleans,
and the mismatched KL rows."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator

from tunebook.config import KTOConfig, parse_config
from tunebook.errors import ConfigError, DataError
from tunebook.models import build_causal_lm
from tunebook.preference import (
    KTOCollator,
    KTOStats,
    kto_loss,
    mismatched_partners,
    prepare_kto_data,
    sequence_log_probs,
    step_kl_and_reference,
    with_kl_rows,
)
from tunebook.preference.kto_data import kl_batch, tokenize_unpaired, weights_advice

BETA, DESIRABLE_WEIGHT, UNDESIRABLE_WEIGHT = 0.3, 1.2, 0.8


def trl_kto_loss(policy_logps, ref_logps, labels, policy_kl_logps, ref_kl_logps, beta, desirable_weight,
                 undesirable_weight):  # fmt: skip
    """TRL's KTO loss, transcribed from `KTOTrainer._compute_loss` (trl/trainer/kto_trainer.py, huggingface/trl
    f2cd57710ae345ea6428ae95363267fcf38a3dc8, loss_type "kto"), one process (`gather_for_metrics` of one value is
    that value). Returns (loss, losses, chosen_rewards, rejected_rewards, kl)."""
    bool_labels = torch.as_tensor(labels, dtype=torch.bool)
    chosen_idx = torch.nonzero(bool_labels, as_tuple=False).view(-1)
    rejected_idx = torch.nonzero(~bool_labels, as_tuple=False).view(-1)
    chosen_logps = policy_logps.index_select(0, chosen_idx)
    rejected_logps = policy_logps.index_select(0, rejected_idx)
    ref_chosen_logps = ref_logps.index_select(0, chosen_idx)
    ref_rejected_logps = ref_logps.index_select(0, rejected_idx)
    kl = (policy_kl_logps - ref_kl_logps).mean().detach()
    kl = kl.mean().clamp(min=0)
    chosen_logratios = chosen_logps - ref_chosen_logps
    chosen_losses = 1 - F.sigmoid(beta * (chosen_logratios - kl))
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_logratios = rejected_logps - ref_rejected_logps
    rejected_losses = 1 - F.sigmoid(beta * (kl - rejected_logratios))
    rejected_rewards = beta * rejected_logratios.detach()
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    return losses.nanmean(), losses, chosen_rewards, rejected_rewards, kl


ROWS = {
    "prompt": ["Reverse the digits.\n1234", [{"role": "user", "content": "Sort the digits.\n391"}], "Copy.\n77",
               "Reverse the digits.\n908", "Sort the digits.\n5021"],
    "completion": ["4321", [{"role": "assistant", "content": "139"}], "7", "809", "0125"],
    "label": [True, False, False, True, True],
}  # fmt: skip


def _rows(tokenizer, rows=ROWS, max_seq_length=64, paired=False):
    import datasets

    n = len(next(iter(rows.values())))
    out = tokenize_unpaired(rows, list(range(n)), tokenizer=tokenizer, max_seq_length=max_seq_length,
                            overlong="truncate", where="rows.jsonl", paired=paired)  # fmt: skip
    return datasets.Dataset.from_dict({k: v for k, v in out.items() if k not in ("keep", "truncated")})


def _direct_log_prob(model, input_ids, labels) -> float:
    """log p(completion | prompt) from the full logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([input_ids])).logits[0].double()
    return sum(torch.log_softmax(logits[t - 1], -1)[labels[t]].item() for t in range(1, len(input_ids))
               if labels[t] != -100)  # fmt: skip


def test_the_loss_rewards_and_kl_equal_trls_on_a_tiny_model(tiny_tokenizer, tiny_model_config, tmp_path):
    rows = with_kl_rows(_rows(tiny_tokenizer), 64, tmp_path)
    torch.manual_seed(1)  # seeds whose mean KL-row log-ratio is positive: z0 is not clamped
    policy = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config).eval()
    torch.manual_seed(0)
    reference = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config).eval()
    batch = KTOCollator(tiny_tokenizer.pad_token_id, 8)(list(rows))
    accelerator = Accelerator(cpu=True)
    kl, (ref,) = step_kl_and_reference(policy, reference, [batch], "sdpa", torch.float32, accelerator)
    pi = sequence_log_probs(policy, batch)
    losses, rewards = kto_loss(pi.double(), ref.double(), batch["label"], kl, BETA, DESIRABLE_WEIGHT,
                               UNDESIRABLE_WEIGHT)  # fmt: skip

    # The log-probabilities are the full logits' (rows and KL rows), and z0 is positive here, so not clamped.
    for i, row in enumerate(rows):
        assert pi[i].item() == pytest.approx(_direct_log_prob(policy, row["input_ids"], row["labels"]), abs=1e-5)
        assert ref[i].item() == pytest.approx(_direct_log_prob(reference, row["input_ids"], row["labels"]), abs=1e-5)
    kl_rows = kl_batch(batch)
    pi_kl, ref_kl = sequence_log_probs(policy, kl_rows), sequence_log_probs(reference, kl_rows)
    direct_kl = [_direct_log_prob(m, r["kl_input_ids"], r["kl_labels"]) for r in rows for m in (policy, reference)]
    assert (pi_kl - ref_kl).tolist() == pytest.approx([a - b for a, b in zip(direct_kl[::2], direct_kl[1::2])],
                                                      abs=1e-5)  # fmt: skip

    loss, trl_losses, chosen, rejected, trl_kl = trl_kto_loss(
        pi.double(),
        ref.double(),
        batch["label"],
        pi_kl.double(),
        ref_kl.double(),
        BETA,
        DESIRABLE_WEIGHT,
        UNDESIRABLE_WEIGHT,
    )
    assert trl_kl.item() > 0 and kl.item() == pytest.approx(trl_kl.item(), abs=1e-6)
    desirable = batch["label"]
    assert torch.cat([losses[desirable], losses[~desirable]]).tolist() == pytest.approx(trl_losses.tolist(), abs=1e-6)
    assert losses.mean().item() == pytest.approx(loss.item(), abs=1e-6)
    assert rewards[desirable].tolist() == pytest.approx(chosen.tolist(), abs=1e-6)
    assert rewards[~desirable].tolist() == pytest.approx(rejected.tolist(), abs=1e-6)

    # The paper's Eq. (7) written out; and the logged means.
    for i in range(len(rows)):
        r = pi[i].item() - ref[i].item()
        sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
        expected = (DESIRABLE_WEIGHT * (1 - sigmoid(BETA * (r - kl.item()))) if rows[i]["label"]
                    else UNDESIRABLE_WEIGHT * (1 - sigmoid(BETA * (kl.item() - r))))  # fmt: skip
        assert losses[i].item() == pytest.approx(expected, abs=1e-6)
    stats = KTOStats("cpu")
    stats.add(losses, rewards, desirable)
    stats.add_kl(kl)
    means = stats.pop(accelerator)
    assert means["loss"] == pytest.approx(loss.item()) and means["kl"] == pytest.approx(trl_kl.item())
    assert means["rewards/margin"] == pytest.approx(chosen.mean().item() - rejected.mean().item())
    assert stats.pop(accelerator)["loss"] is None  # an empty window


def test_the_reference_point_is_clamped_and_independent_of_the_micro_batches(tiny_tokenizer, tiny_model_config,
                                                                             tmp_path):  # fmt: skip
    rows = list(with_kl_rows(_rows(tiny_tokenizer), 64, tmp_path))
    torch.manual_seed(1)
    policy = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config).eval()
    torch.manual_seed(0)
    reference = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config).eval()
    collate, accelerator = KTOCollator(tiny_tokenizer.pad_token_id), Accelerator(cpu=True)
    whole, (ref,) = step_kl_and_reference(policy, reference, [collate(rows)], "sdpa", torch.float32, accelerator)
    split, refs = step_kl_and_reference(policy, reference, [collate(rows[:2]), collate(rows[2:])], "sdpa",
                                        torch.float32, accelerator)  # fmt: skip
    assert (
        whole.item() > 0
        and split.item() == pytest.approx(whole.item(), abs=1e-6)
        and torch.allclose(torch.cat(refs), ref, atol=1e-5)
    )
    # TRL's per-micro-batch reference point differs between the halves: its loss depends on the split.
    kl_rows = kl_batch(collate(rows))
    terms = sequence_log_probs(policy, kl_rows) - sequence_log_probs(reference, kl_rows)
    assert terms[:2].mean().clamp(min=0).item() != pytest.approx(terms[2:].mean().clamp(min=0).item(), abs=1e-3)
    # The policy as its own reference: every log-ratio 0, z0 0; a negative mean is clamped at 0.
    same, _ = step_kl_and_reference(policy, policy, [collate(rows)], "sdpa", torch.float32, accelerator)
    assert same.item() == 0
    losses, rewards = kto_loss(torch.zeros(3), torch.zeros(3), torch.tensor([True, False, True]), same, BETA)
    assert losses.tolist() == [0.5] * 3 and rewards.tolist() == [0.0] * 3
    batch = collate(rows)
    precomputed = {**batch, "ref_logps": ref, "ref_kl_logps": sequence_log_probs(policy, kl_rows) + 5.0}
    clamped, _ = step_kl_and_reference(policy, None, [precomputed], "sdpa", torch.float32, accelerator)
    assert clamped.item() == 0.0  # the mean log-ratio is -5


def test_kl_rows_pair_each_prompt_with_another_prompts_completion(tiny_tokenizer, tmp_path):
    # Pairs split into rows: each pair's two rows share a prompt, so the row before is skipped where it shares it.
    assert mismatched_partners([7, 7, 8, 8, 9, 9]) == [5, 5, 1, 1, 3, 3]
    assert mismatched_partners([1, 2, 3]) == [2, 0, 1]  # TRL's rotation by one
    assert mismatched_partners([4, 4]) == [1, 0]  # a single prompt: the neighbour anyway
    pairs = {"prompt": ["Reverse.\n12", "Sort.\n31", "Copy.\n5"], "chosen": ["21", "13", "5"],
             "rejected": ["12", "31", "55"]}  # fmt: skip
    rows = _rows(tiny_tokenizer, pairs, paired=True)
    assert rows["label"] == [True, False] * 3
    assert rows["input_ids"][0][: rows["prompt_length"][0]] == rows["input_ids"][1][: rows["prompt_length"][1]]
    short = 2 + max(rows["prompt_length"])  # room for two completion tokens after the longest prompt
    with_kl = with_kl_rows(rows, short, tmp_path)
    partners = mismatched_partners(rows["prompt_key"])
    for i, row in enumerate(with_kl):
        length, other = row["prompt_length"], with_kl[partners[i]]
        assert row["prompt_key"] != other["prompt_key"]
        completion = other["input_ids"][other["prompt_length"] :][: short - length]
        assert row["kl_input_ids"] == row["input_ids"][:length] + completion and len(row["kl_input_ids"]) <= short
        assert row["kl_labels"] == [-100] * length + completion


def test_unpaired_and_paired_files_and_a_label_that_is_not_a_boolean(tmp_path, caplog):
    unpaired = tmp_path / "unpaired.jsonl"
    unpaired.write_text("".join(json.dumps({k: ROWS[k][i] for k in ROWS}) + "\n" for i in range(5)))
    config = KTOConfig(train_data=str(unpaired), eval_split_ratio=0, max_seq_length=64, tokenizer_vocab_size=300,
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="test"):
        data = prepare_kto_data(config, tmp_path / "cache", logging.getLogger("test"))
    assert data.train["label"] == ROWS["label"] and data.eval is None
    assert {"kl_input_ids", "kl_labels"} <= set(data.train.column_names)
    assert "3 desirable and 2 undesirable rows: the KTO paper advises desirable_weight in [0.67, 0.89]" in caplog.text
    assert weights_advice(3, 2, 0.8, 1.0) == "" and weights_advice(4, 4, 1.0, 5.0) == ""

    paired = tmp_path / "pairs.jsonl"
    paired.write_text(json.dumps({"prompt": "Reverse.\n12", "chosen": "21", "rejected": "12"}) + "\n")
    config.train_data = str(paired)
    assert prepare_kto_data(config, tmp_path / "cache", logging.getLogger("test")).train["label"] == [True, False]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "completion": "b", "label": True}) + "\n"
                   + json.dumps({"prompt": "a", "completion": "c", "label": "yes"}) + "\n")  # fmt: skip
    config.train_data = str(bad)
    with pytest.raises(DataError, match=r"bad.jsonl, row 2: column 'label' must be true \(desirable\) or false "
                                        r"\(undesirable\), got 'yes'") as error:  # fmt: skip
        prepare_kto_data(config, tmp_path / "cache", logging.getLogger("test"))
    assert "\n" not in str(error.value)
    neither = tmp_path / "neither.jsonl"
    neither.write_text(json.dumps({"prompt": "a", "answer": "b"}) + "\n")
    config.train_data = str(neither)
    with pytest.raises(DataError, match="needs columns prompt, completion and label"):
        prepare_kto_data(config, tmp_path / "cache", logging.getLogger("test"))


def test_the_weights_and_beta_are_checked():
    for key in ("beta", "desirable_weight", "undesirable_weight"):
        with pytest.raises(ConfigError, match=f"config key .{key}. must be > 0, got 0.0"):
            parse_config(KTOConfig, None, {key: 0.0}, "test")
