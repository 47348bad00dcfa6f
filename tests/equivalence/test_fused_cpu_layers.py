"""`fused_cpu_layers`: the fused RMSNorm and rotary embedding equal transformers' own (outputs and every gradient,
float32, 1e-5), are used only for code that is Llama's, and step aside for anything but float32 CPU tensors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import tunebook.models.fused_cpu as fused_cpu
from tunebook.data import PackedCollator, attention_inputs, use_packed_attention
from tunebook.models import build_causal_lm
from tunebook.training import causal_lm_token_losses

TOL = 1e-5


def _model(model_type: str, **extra):
    values = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **values, **extra)).train()


def _packed_batch() -> dict:
    g = torch.Generator().manual_seed(0)
    rows = []
    for sizes in ([9, 14, 5], [20, 7]):
        ids = torch.randint(1, 97, (sum(sizes),), generator=g).tolist()
        labels = list(ids)
        for start in torch.tensor([0, *sizes[:-1]]).cumsum(0).tolist():
            labels[start] = -100
        rows.append({"input_ids": ids, "labels": labels, "seq_lengths": sizes})
    return PackedCollator(0, 8)(rows)


def _loss_and_grads(model, batch, fused: bool):
    fused_cpu.set_fused_cpu_layers(model, fused)
    model.zero_grad(set_to_none=True)
    attn = model.config._attn_implementation
    losses, _ = causal_lm_token_losses(model, attention_inputs(batch, attn, torch.float32), batch)
    (losses * torch.linspace(0.5, 1.5, len(losses))).sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("model_type", "fused_names"),
    [
        ("llama", ["LlamaRMSNorm", "modeling_llama.apply_rotary_pos_emb"]),
        ("qwen3", ["Qwen3RMSNorm", "modeling_qwen3.apply_rotary_pos_emb"]),  # also the per-head q/k norms
        ("mistral", ["MistralRMSNorm", "modeling_mistral.apply_rotary_pos_emb"]),
        ("gemma", ["modeling_gemma.apply_rotary_pos_emb"]),  # its RMSNorm scales by 1 + weight: not Llama's
    ],
)
def test_fused_layers_equal_transformers_on_a_packed_batch(model_type, fused_names, monkeypatch):
    model = _model(model_type)
    assert fused_cpu.set_fused_cpu_layers(model) == fused_names
    use_packed_attention(model, torch.device("cpu"))
    batch = _packed_batch()
    calls = []
    for function in (fused_cpu._RMSNorm, fused_cpu._Rotary):
        counted = lambda *args, _apply=function.apply, _name=function.__name__: calls.append(_name) or _apply(*args)  # noqa: E731
        monkeypatch.setattr(function, "apply", counted)
    expected_losses, expected_grads = _loss_and_grads(model, batch, fused=False)
    assert not calls
    losses, grads = _loss_and_grads(model, batch, fused=True)
    assert "_Rotary" in calls and ("_RMSNorm" in calls) == any(n.endswith("RMSNorm") for n in fused_names)
    torch.testing.assert_close(losses, expected_losses, atol=TOL, rtol=TOL)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=TOL, rtol=TOL, msg=f"gradient of {name}")


def test_functions_equal_the_reference_with_broadcasting_and_a_frozen_weight():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 11, 16, generator=g, requires_grad=True)
    cos, sin = torch.randn(3, 1, 11, 16, generator=g), torch.randn(3, 1, 11, 16, generator=g)
    upstream = torch.randn(3, 4, 11, 16, generator=g)

    def rotate_half(t):
        return torch.cat((-t[..., 8:], t[..., :8]), dim=-1)

    expected = x * cos + rotate_half(x) * sin
    (expected_grad,) = torch.autograd.grad((expected * upstream).sum(), x)
    out = fused_cpu._Rotary.apply(x, cos, sin)
    (grad,) = torch.autograd.grad((out * upstream).sum(), x)
    torch.testing.assert_close(out, expected, atol=TOL, rtol=TOL)
    torch.testing.assert_close(grad, expected_grad, atol=TOL, rtol=TOL)

    weight = torch.randn(16, generator=g)  # frozen, as under LoRA: no gradient asked for or returned
    expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    (expected_grad,) = torch.autograd.grad((expected * upstream).sum(), x)
    out = fused_cpu._RMSNorm.apply(x, weight, 1e-6)
    (grad,) = torch.autograd.grad((out * upstream).sum(), x)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)  # the same ops in the same order
    torch.testing.assert_close(grad, expected_grad, atol=TOL, rtol=TOL)


def test_other_dtypes_and_the_setting_off_take_transformers_path(monkeypatch):
    model = _model("llama")
    fused_cpu.set_fused_cpu_layers(model)
    monkeypatch.setattr(fused_cpu._Rotary, "apply", lambda *a: pytest.fail("fused rotary on a bf16 tensor"))
    ids = torch.randint(1, 97, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # q and k in bf16, the rotary tables (and RMSNorm) in float32
        model(input_ids=ids)
    monkeypatch.setattr(fused_cpu._RMSNorm, "apply", lambda *a: pytest.fail("fused RMSNorm on a bf16 tensor"))
    model.to(torch.bfloat16)(input_ids=ids)
    model.float()
    assert fused_cpu.set_fused_cpu_layers(model, enabled=False) == []
    model(input_ids=ids)


def test_only_code_that_is_llamas_is_patched():
    llama = _model("llama")
    assert fused_cpu._same_code(type(llama.model.norm).forward, "rms_norm")
    gemma = _model("gemma")
    norm = next(m for m in gemma.modules() if type(m).__name__.endswith("RMSNorm"))
    assert not fused_cpu._same_code(type(norm).forward, "rms_norm")

    def rotate_half(x):  # a different body: not patched
        return torch.cat((x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)

    assert not fused_cpu._same_code(rotate_half, "rotate_half")


def test_recipes_build_with_the_setting(tiny_tokenizer, tiny_model_config):
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config)
    assert fused_cpu.fused_cpu_layers_of(model) and "forward" in vars(model.model.norm)
    other = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config, fused_cpu_layers=False)
    assert not fused_cpu.fused_cpu_layers_of(other)
    assert fused_cpu.fused_cpu_layers_of(model)  # each model keeps its own setting


def test_only_the_model_given_changes_and_its_code_comes_back():
    import copy

    import transformers.models.llama.modeling_llama as modeling_llama

    classes = modeling_llama.LlamaRMSNorm.forward, modeling_llama.LlamaAttention.forward
    rotary = modeling_llama.apply_rotary_pos_emb
    model, other = _model("llama"), _model("llama")
    fused_cpu.set_fused_cpu_layers(model)
    assert (modeling_llama.LlamaRMSNorm.forward, modeling_llama.LlamaAttention.forward) == classes
    assert modeling_llama.apply_rotary_pos_emb is rotary
    assert not fused_cpu.fused_cpu_layers_of(other)
    reference = copy.deepcopy(model)  # DPO's frozen reference: fused, bound to its own modules
    assert reference.model.norm.forward.__self__ is reference.model.norm
    assert fused_cpu.fused_cpu_layers_of(reference)
    assert fused_cpu.set_fused_cpu_layers(model, enabled=False) == []
    assert not any("forward" in vars(m) for m in model.modules())


def test_rotary_tables_that_would_widen_q_take_transformers_path():
    import transformers.models.llama.modeling_llama as modeling_llama

    fused = fused_cpu._fused_apply_rotary_pos_emb(modeling_llama.apply_rotary_pos_emb)
    q = torch.randn(1, 4, 6, 16, requires_grad=True)  # one row of queries, tables for two rows
    cos, sin = torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    out, _ = fused(q, q, cos, sin)
    expected, _ = modeling_llama.apply_rotary_pos_emb(q, q, cos, sin)
    assert out.shape == (2, 4, 6, 16)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    out.sum().backward()
    assert q.grad.shape == q.shape
