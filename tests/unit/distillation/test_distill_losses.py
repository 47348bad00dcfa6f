"""The distillation loss against its definition, against TRL's `generalized_jsd_loss`, and computed from the two
output layers a chunk at a time against the same loss on whole logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tunebook.data import PadCollator, attention_inputs
from tunebook.distillation import distill_token_losses, generalized_jsd, token_losses
from tunebook.distillation import losses as losses_module
from tunebook.models import build_causal_lm, linear_ce

BETAS = (0.0, 0.5, 1.0)


def trl_generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0,
                             reduction="batchmean"):  # fmt: skip
    """Transcribed from TRL, trl/trainer/gkd_trainer.py, `GKDTrainer.generalized_jsd_loss` (TRL 0.13-0.19; the
    comments and docstring left out)."""
    student_logits = student_logits / temperature
    teacher_logits = teacher_logits / temperature
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta = torch.tensor(beta, dtype=student_log_probs.dtype)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log(1 - beta), teacher_log_probs + torch.log(beta)]),
            dim=0,
        )
        kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
        jsd = beta * kl_teacher + (1 - beta) * kl_student
    if labels is not None:
        mask = labels != -100
        jsd = jsd[mask]
    if reduction == "batchmean":
        return jsd.sum() / mask.sum() if labels is not None else jsd.sum() / jsd.size(0)
    elif reduction == "sum":
        return jsd.sum()
    elif reduction == "mean":
        return jsd.mean()
    else:
        return jsd


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p * (p / q).log()).sum(-1)


@pytest.mark.parametrize("beta", BETAS)
def test_the_divergence_is_the_papers_definition(beta):
    """From probabilities, in float64: KL(p_T || p_S), KL(p_S || p_T), and the mixture's generalized JSD."""
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, generator=g, dtype=torch.float64).unbind(0)
    p_s, p_t = (student / 0.7).softmax(-1), (teacher / 0.7).softmax(-1)
    if beta == 0:
        expected = _kl(p_t, p_s)
    elif beta == 1:
        expected = _kl(p_s, p_t)
    else:
        mixture = (1 - beta) * p_s + beta * p_t
        expected = beta * _kl(p_t, mixture) + (1 - beta) * _kl(p_s, mixture)
    torch.testing.assert_close(generalized_jsd(student, teacher, beta, 0.7).double(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("beta", BETAS)
def test_the_masked_token_mean_equals_trls_generalized_jsd_loss(beta):
    g = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(2, 3, 7, 50, generator=g).unbind(0)
    labels = torch.randint(0, 50, (3, 7), generator=g)
    labels[0, :3] = labels[1, :5] = labels[2, 6] = -100  # prompts and padding carry no loss
    mask = labels != -100
    ours = generalized_jsd(student[mask], teacher[mask], beta, 0.9).sum() / mask.sum()
    theirs = trl_generalized_jsd_loss(student, teacher, labels, beta=beta, temperature=0.9)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert ours > 0.01  # not vacuous: the two distributions differ


def test_alpha_mixes_in_the_students_cross_entropy():
    g = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(2, 6, 20, generator=g).unbind(0)
    targets = torch.randint(0, 20, (6,), generator=g)
    divergence = generalized_jsd(student, teacher, 0.5, 1.0)
    cross_entropy = F.cross_entropy(student, targets, reduction="none")
    mixed = token_losses(student, teacher, targets, 0.5, 1.0, alpha=0.25)
    torch.testing.assert_close(mixed, 0.75 * divergence + 0.25 * cross_entropy)


def _models_and_batch(tokenizer, config, teacher_width=64):
    torch.manual_seed(0)
    student = build_causal_lm(tokenizer, model_config=config, attn_implementation="eager")
    teacher_config = {**config, "hidden_size": teacher_width, "intermediate_size": 2 * teacher_width}
    teacher = build_causal_lm(tokenizer, model_config=teacher_config, attn_implementation="eager")
    teacher.requires_grad_(False).eval()
    g = torch.Generator().manual_seed(3)
    rows = []
    for i, length in enumerate((9, 14, 6)):
        ids = torch.randint(10, len(tokenizer), (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * (2 + i) + ids[2 + i :]})
    return student, teacher, PadCollator(tokenizer.pad_token_id)(rows)


def _whole_logits_loss(student, teacher, batch, beta):
    """The plain computation: both models' full logits, the shift, the mask, `token_losses` on the kept rows."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        teacher_logits = teacher(**inputs).logits[:, :-1]
    student_logits = student(**inputs).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    return token_losses(student_logits[mask], teacher_logits[mask], targets[mask], beta, 0.9, 0.1)


@pytest.mark.parametrize(
    "beta, chunk_elements",
    [(0.0, None), (0.5, None), (1.0, None), (0.0, 600), (0.5, 600)],
    ids=["forward KL", "JSD", "reverse KL", "forward KL in chunks of 2 rows", "JSD in chunks of 2 rows"],
)
def test_losses_from_the_output_layers_equal_those_of_whole_logits(beta, chunk_elements, tiny_tokenizer,
                                                                   tiny_model_config, monkeypatch):  # fmt: skip
    """Chunked (2 rows of the 300-token vocabulary at a time, recomputed in the backward) or not: the same losses
    and the same gradients as the loss on both models' whole logits."""
    chunks = []
    if chunk_elements:
        monkeypatch.setattr(linear_ce, "CHUNK_ELEMENTS", chunk_elements)
        real = losses_module.checkpoint
        monkeypatch.setattr(losses_module, "checkpoint", lambda *a, **k: chunks.append(len(a[1])) or real(*a, **k))
    student, teacher, batch = _models_and_batch(tiny_tokenizer, tiny_model_config)
    inputs = attention_inputs(batch, "eager", torch.float32)
    losses, positions = distill_token_losses(student, teacher, inputs, inputs, batch, beta=beta, temperature=0.9,
                                             alpha=0.1)  # fmt: skip
    losses.sum().backward()
    grads = {name: p.grad.clone() for name, p in student.named_parameters()}
    student.zero_grad()
    expected = _whole_logits_loss(student, teacher, batch, beta)
    expected.sum().backward()
    assert len(positions) == len(expected) == int((batch["labels"][:, 1:] != -100).sum())
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")
    assert all(p.grad is None for p in teacher.parameters())
    if chunk_elements:  # the fused path ran, in chunks of 2 rows
        assert sum(chunks) == len(positions) and max(chunks) == 2


def test_a_model_that_changes_its_logits_after_the_head_gets_them_at_the_loss_positions(tiny_tokenizer,
                                                                                        tiny_model_config):  # fmt: skip
    """Gemma-2's soft-capping and the like: the loss is taken from the logits the model returns."""
    student, teacher, batch = _models_and_batch(tiny_tokenizer, tiny_model_config)
    for model in (student, teacher):
        original = model.forward

        def capped(*args, _forward=original, **kwargs):
            out = _forward(*args, **kwargs)
            out.logits = 3 * torch.tanh(out.logits / 3)
            return out

        model.forward = capped
    student.config.final_logit_softcapping = 3.0  # what marks such a model as not fusable
    inputs = attention_inputs(batch, "eager", torch.float32)
    losses, _ = distill_token_losses(student, teacher, inputs, inputs, batch, beta=0.5, temperature=0.9, alpha=0.1)
    torch.testing.assert_close(losses, _whole_logits_loss(student, teacher, batch, 0.5), rtol=1e-5, atol=1e-6)
