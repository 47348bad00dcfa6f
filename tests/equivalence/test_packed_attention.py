"""Packed examples must not see each other: every token's loss inside a packed row equals its loss alone.

Checked per attention backend, in training and in evaluation mode, in float32 to 1e-5. The last test shows the
comparison is sensitive: a packed row given a plain 2D attention mask (what transformers does with a padded
batch) lets examples attend across their boundaries and fails it by orders of magnitude.
"""

from __future__ import annotations

import contextlib

import datasets
import pytest
import torch
import torch.nn.functional as F

from tunebook.data.collate import PackedCollator
from tunebook.data.packing import pack_dataset
from tunebook.models import build_causal_lm
from tunebook.models.attention import SEGMENT_SDPA, attention_inputs, use_packed_attention

TOL = 1e-5
LENGTHS = [9, 4, 13, 6, 3, 11, 7, 5]


def _backends():
    """(attn_implementation, device): every backend on the CPU, and on a CUDA GPU when there is one."""
    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    # FlexAttention (packed rows as a document block mask) only on CUDA: it has no backward pass on a CPU, and its CPU
    # kernel gave intermittent NaNs at these tiny shapes under pytest (never in a fresh process).
    backends = [("sdpa", "cpu"), ("eager", "cpu"), (SEGMENT_SDPA, "cpu")]
    backends += [
        pytest.param(a, "cuda", marks=[pytest.mark.gpu, cuda])
        for a in ("sdpa", "eager", SEGMENT_SDPA, "flex_attention")
    ]
    try:
        import flash_attn  # noqa: F401

        backends.append(pytest.param("flash_attention_2", "cuda", marks=[pytest.mark.gpu, cuda]))
    except ImportError:
        pass
    return backends


def _examples(tokenizer):
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(10, len(tokenizer), (n,), generator=g).tolist() for n in LENGTHS]
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


def _token_losses(logits, ids):
    return F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="none")


def _packed_and_alone(model, tokenizer, attn, device="cpu"):
    dtype = next(model.parameters()).dtype
    examples = _examples(tokenizer)
    packed, _ = pack_dataset(examples, 24, seed=0)
    batch = PackedCollator(tokenizer.pad_token_id, 8, attn)(list(packed))  # flex: the tiles made as in a worker
    assert batch["seq_ids"].max() >= 2, "rows must hold several examples for the test to mean anything"
    batch = {k: v.to(device) for k, v in batch.items()}
    logits = model(**attention_inputs(batch, attn, dtype)).logits
    pairs = []
    for row in range(len(packed)):
        start = 0
        for n in packed[row]["seq_lengths"]:
            ids = batch["input_ids"][row : row + 1, start : start + n]
            in_row = F.cross_entropy(logits[row, start : start + n - 1].float(), ids[0, 1:], reduction="none")
            alone = _token_losses(model(input_ids=ids, use_cache=False).logits, ids)
            pairs.append((in_row, alone))
            start += n
    assert len(pairs) == len(LENGTHS)
    return pairs


@pytest.mark.parametrize("attn, device", _backends())
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_packed_token_losses_equal_losses_alone(attn, device, mode, tiny_tokenizer, tiny_model_config):
    torch.manual_seed(0)
    build_attn = "sdpa" if attn == SEGMENT_SDPA else attn
    if attn == "flex_attention":  # its kernels need heads of 16 or more (the tiny model's are 8)
        tiny_model_config = {**tiny_model_config, "head_dim": 16}
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config, attn_implementation=build_attn).to(device)
    if attn == SEGMENT_SDPA:
        model.set_attn_implementation(use_packed_attention(model, "cpu"))  # registers it; on CUDA chosen by hand
    flash = attn.startswith("flash") or (attn == SEGMENT_SDPA and device == "cuda")  # torch's flash varlen kernel
    if flash:
        model = model.to(torch.bfloat16)
    model.train(mode == "train")
    # flash kernels run in bf16 only; CUDA kernels sum in another order for the packed and the lone shapes
    tol = 2e-2 if flash else (1e-4 if device == "cuda" else TOL)
    with torch.no_grad():
        for in_row, alone in _packed_and_alone(model, tiny_tokenizer, attn, device):
            torch.testing.assert_close(in_row, alone, atol=tol, rtol=tol)


# Gradients, in the precision training runs in. The forward test above runs CUDA in float32, where SDPA with a mask
# takes the memory-efficient kernel; bf16 training on an H100 takes cuDNN's (picked first there since PyTorch 2.5),
# whose backward with an explicit mask has had silent-wrong-gradient bugs (pytorch#196678: NaN dQ for rows of
# 64 mod 128; pytorch#191612: a float mask read as bf16). Examples of 40 to 200 tokens in rows of 320 (64 mod 128),
# heads of 64 as in the 1B-8B Llamas.
GRAD_LENGTHS = [150, 40, 90, 200, 70, 130, 60, 110]
GRAD_MODEL = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}


def _gradient_backends():
    """(attn_implementation, SDPA kernel the packed rows must use, None for PyTorch's choice or "compiled" for
    compiled blocks, device)."""
    cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
    backends = [(a, None, "cpu") for a in ("sdpa", "eager", SEGMENT_SDPA)]
    backends += [pytest.param("sdpa", k, "cuda", marks=cuda)
                 for k in (None, "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")]  # fmt: skip
    backends += [pytest.param(a, None, "cuda", marks=cuda) for a in ("eager", SEGMENT_SDPA, "flex_attention")]
    # torch_compile's blocks (compiled and eager 1B runs on an H100 ended 0.15 apart in loss; RESULTS.md)
    backends += [("sdpa", "compiled", "cpu"), pytest.param("sdpa", "compiled", "cuda", marks=cuda)]
    return backends


def _summed_loss_gradients(model, batch, attn, bf16: bool, kernel: str | None = None):
    """Parameter gradients of the summed token loss of the packed `batch` (attn given) or of its examples one by one,
    each example alone (attn None), in float32 or under bf16 autocast."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model.zero_grad(set_to_none=True)
    device = batch["input_ids"].device.type
    restrict = sdpa_kernel([getattr(SDPBackend, kernel)]) if kernel else contextlib.nullcontext()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16), restrict:
        if attn is not None:
            logits = model(**attention_inputs(batch, attn, torch.float32)).logits
            F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                            reduction="sum").backward()  # fmt: skip
        else:
            for row, lengths in enumerate(batch["seq_lengths"]):
                start = 0
                for n in lengths:
                    ids = batch["input_ids"][row : row + 1, start : start + n]
                    _token_losses(model(input_ids=ids, use_cache=False).logits, ids).sum().backward()
                    start += n
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _relative_errors(grads, reference):
    return {n: ((g.float() - reference[n]).norm() / reference[n].norm()).item() for n, g in grads.items()}


@pytest.mark.parametrize("attn, kernel, device", _gradient_backends())
def test_packed_gradients_under_bf16_autocast_are_as_exact_as_gradients_alone(attn, kernel, device, tiny_tokenizer,
                                                                            tiny_model_config):  # fmt: skip
    """Training's gradients through packed rows, per backend (on CUDA SDPA per kernel), against float32 SDPA run on
    each example alone: in float32 they are equal (1e-5 on a CPU, 1e-4 on CUDA); under bf16 autocast each parameter's
    gradient is off by no more than twice the error of the examples run alone under autocast (plus 2e-3), so a kernel
    that is wrong only with a mask, or only in its backward, fails while rounding does not."""
    torch.manual_seed(0)
    model = build_causal_lm(tiny_tokenizer, model_config={**tiny_model_config, **GRAD_MODEL},
                            attn_implementation="sdpa").to(device)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(10, len(tiny_tokenizer), (n,), generator=g).tolist() for n in GRAD_LENGTHS]
    packed, _ = pack_dataset(datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}), 320, seed=0)
    batch = {k: v.to(device) for k, v in PackedCollator(tiny_tokenizer.pad_token_id, 8, attn)(list(packed)).items()}
    batch["seq_lengths"] = [row["seq_lengths"] for row in packed]
    assert batch["input_ids"].shape[1] % 128 == 64 and max(map(len, batch["seq_lengths"])) >= 3
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        reference = _summed_loss_gradients(model, batch, None, bf16=False)
    alone_bf16 = _relative_errors(_summed_loss_gradients(model, batch, None, bf16=True), reference)
    if attn == SEGMENT_SDPA:
        use_packed_attention(model, "cpu")  # registers it; on CUDA packing picks it for sliding windows only
    model.set_attn_implementation(attn)
    if kernel == "compiled":
        from tunebook.training.compilation import compile_blocks

        compile_blocks(model, static=True)
        kernel = None
    float32 = _relative_errors(_summed_loss_gradients(model, batch, attn, bf16=False), reference)
    assert max(float32.values()) < (1e-5 if device == "cpu" else 1e-4), float32
    try:
        packed_bf16 = _relative_errors(_summed_loss_gradients(model, batch, attn, True, kernel), reference)
    except RuntimeError as e:
        if "No available kernel" not in str(e):
            raise
        pytest.skip(f"{kernel} does not take these inputs here: {str(e).splitlines()[0]}")
    worse = {n: (e, alone_bf16[n]) for n, e in packed_bf16.items() if not e <= 2 * alone_bf16[n] + 2e-3}
    assert not worse, f"packed gradients' relative error vs alone's (parameter: (packed, alone)): {worse}"


def test_a_plain_2d_mask_lets_packed_examples_attend_to_each_other(tiny_tokenizer, tiny_model_config):
    torch.manual_seed(0)
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config, attn_implementation="sdpa").eval()
    packed, _ = pack_dataset(_examples(tiny_tokenizer), 24, seed=0)
    batch = PackedCollator(tiny_tokenizer.pad_token_id, 8)(list(packed))
    with torch.no_grad():
        good = model(**attention_inputs(batch, "sdpa", torch.float32)).logits
        leaky = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    assert (good - leaky).abs().max().item() > 1000 * TOL


def test_the_cpu_varlen_backend_leaves_padded_batches_and_generation_unchanged(tiny_tokenizer, tiny_model_config):
    """After `use_packed_attention` switches a model to per-example SDPA, unpacked inputs still get SDPA's masks."""
    torch.manual_seed(0)
    plain = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config, attn_implementation="sdpa").eval()
    torch.manual_seed(0)
    switched = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config, attn_implementation="sdpa").eval()
    assert use_packed_attention(switched, "cpu") == SEGMENT_SDPA
    ids = torch.randint(10, len(tiny_tokenizer), (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding, as in batched generation
    ids[1, :4] = tiny_tokenizer.pad_token_id
    with torch.no_grad():
        torch.testing.assert_close(switched(input_ids=ids, attention_mask=mask).logits,
                                   plain(input_ids=ids, attention_mask=mask).logits, atol=TOL, rtol=TOL)  # fmt: skip
        kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": tiny_tokenizer.pad_token_id}
        assert torch.equal(switched.generate(input_ids=ids, attention_mask=mask, **kwargs),
                           plain.generate(input_ids=ids, attention_mask=mask, **kwargs))  # fmt: skip


def test_cpu_varlen_attention_under_bf16_autocast_matches_the_block_mask(tiny_tokenizer, tiny_model_config):
    """Under bf16 autocast the per-example attention runs in fp32 (faster on CPUs): same logits and gradients as
    SDPA with the block-diagonal mask, to bf16 precision, and its output keeps the autocast dtype."""
    results = {}
    for attn in ("sdpa", SEGMENT_SDPA):
        torch.manual_seed(0)
        model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config, attn_implementation="sdpa")
        if attn == SEGMENT_SDPA:
            use_packed_attention(model, "cpu")
        packed, _ = pack_dataset(_examples(tiny_tokenizer), 24, seed=0)
        batch = PackedCollator(tiny_tokenizer.pad_token_id, 8)(list(packed))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(**attention_inputs(batch, attn, torch.float32)).logits
        assert logits.dtype == torch.bfloat16
        logits.float().square().mean().backward()
        results[attn] = (logits.float(), {n: p.grad for n, p in model.named_parameters()})
    (ref_logits, ref_grads), (logits, grads) = results["sdpa"], results[SEGMENT_SDPA]
    torch.testing.assert_close(logits, ref_logits, atol=3e-2, rtol=3e-2)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=3e-2, rtol=5e-2, msg=f"gradient of {name}")


def test_flex_attention_packing_on_a_cpu_stops_with_one_line(tiny_tokenizer, tiny_model_config):
    from tunebook.errors import ConfigError

    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config, attn_implementation="flex_attention")
    with pytest.raises(ConfigError, match="FlexAttention has no backward pass on a CPU; use sdpa"):
        use_packed_attention(model, "cpu")


def test_flex_attention_packing_of_heads_under_16_stops_with_one_line(tiny_tokenizer, tiny_model_config):
    """FlexAttention's CUDA kernels take heads of 16 or more: the tiny model's 8 stop before the first forward, which
    would fail inside inductor with a page of its IR (seen on an H100)."""
    from tunebook.errors import ConfigError

    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config, attn_implementation="flex_attention")
    with pytest.raises(ConfigError, match="need a head dimension of at least 16 and LlamaForCausalLM has 8; use sdpa"):
        use_packed_attention(model, "cuda")
    wide = build_causal_lm(tiny_tokenizer, model_config={**tiny_model_config, "head_dim": 16},
                           attn_implementation="flex_attention")  # fmt: skip
    assert use_packed_attention(wide, "cuda") == "flex_attention"


TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
# Tiny models with sliding-window layers, in the shapes users bring: every layer windowed (Mistral), windowed layers
# after full ones (Qwen2 with use_sliding_window), local and global layers interleaved (Gemma-3). Window 4 tokens,
# examples of 3 to 13: most examples are longer than the window.
SLIDING = {
    "mistral": {"sliding_window": 4},
    "qwen2": {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1},
    "gemma3_text": {"sliding_window": 4, "head_dim": 8, "layer_types": ["sliding_attention", "full_attention"]},
}


def _tiny_model(model_type: str, attn: str = "sdpa", **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def _sliding_model(model_type: str, attn: str = "sdpa"):
    return _tiny_model(model_type, attn, **SLIDING[model_type])


def _packed_rows(device="cpu", attn=SEGMENT_SDPA):
    """LENGTHS examples of random ids below TINY's vocabulary, packed into rows of 24 and collated."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 100, (n,), generator=g).tolist() for n in LENGTHS]
    packed, _ = pack_dataset(datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}), 24, seed=0)
    batch = {k: v.to(device) for k, v in PackedCollator(0, 8, attn)(list(packed)).items()}
    return batch, [row["seq_lengths"] for row in packed]


def _logits_in_rows_and_alone(model, logits, batch, seq_lengths):
    """(logits of each example inside its packed row, the same example's logits run alone), per example."""
    for row, lengths in enumerate(seq_lengths):
        start = 0
        for n in lengths:
            alone_ids = batch["input_ids"][row : row + 1, start : start + n]
            yield logits[row, start : start + n], model(input_ids=alone_ids, use_cache=False).logits[0]
            start += n


@pytest.mark.parametrize("model_type", list(SLIDING))
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])  # fmt: skip
def test_sliding_window_layers_keep_their_window_inside_packed_examples(model_type, mode, device):
    """Packing a model with sliding-window layers gives every token the loss it has alone, where each layer sees the
    window it was built with (on CUDA too, where sdpa otherwise keeps the mask). The block-diagonal mask (one mask
    for every layer) would have dropped the windows: shown at the end, failing the comparison by orders of
    magnitude."""
    model = _sliding_model(model_type).to(device).train(mode == "train")
    assert use_packed_attention(model, device, max_length=24) == SEGMENT_SDPA
    tol = TOL if device == "cpu" else 1e-4
    batch, seq_lengths = _packed_rows(device)
    with torch.no_grad():
        logits = model(**attention_inputs(batch, SEGMENT_SDPA, torch.float32)).logits
        for in_row, alone in _logits_in_rows_and_alone(model, logits, batch, seq_lengths):
            torch.testing.assert_close(in_row, alone, atol=tol, rtol=tol)
        model.set_attn_implementation("sdpa")
        unwindowed = model(**attention_inputs(batch, "sdpa", torch.float32)).logits
        worst = max((a - b).abs().max() for a, b in _logits_in_rows_and_alone(model, unwindowed, batch, seq_lengths))
    assert worst > 100 * tol  # Qwen2's one windowed layer of two: 0.0945 on an H100, 945 x CUDA's tolerance


@pytest.mark.parametrize("attn", ["eager", "flex_attention"])
def test_packing_a_sliding_window_model_with_one_mask_for_every_layer_stops_with_one_line(attn):
    from tunebook.errors import ConfigError

    model = _tiny_model("gemma3_text", attn, **{**SLIDING["gemma3_text"], "head_dim": 16})  # flex: heads >= 16
    with pytest.raises(ConfigError, match=r"sliding-window attention \(window 4 < max_seq_length 24\).*use "
                                          "attn_implementation sdpa or flash_attention_2, or packing: false"):  # fmt: skip
        use_packed_attention(model, "cuda", max_length=24)
    # A window no example can outgrow changes nothing: the backend stays.
    assert use_packed_attention(model, "cuda", max_length=4) == attn


def test_sliding_window_is_read_from_the_config_only_where_layers_use_it():
    from transformers import AutoConfig

    from tunebook.models.attention import sliding_window

    assert sliding_window(AutoConfig.for_model("mistral", sliding_window=4096)) == 4096
    assert sliding_window(AutoConfig.for_model("mistral", sliding_window=None)) is None
    assert sliding_window(AutoConfig.for_model("qwen2", sliding_window=4096)) is None  # use_sliding_window off
    assert sliding_window(AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=64)) == 64
    assert sliding_window(AutoConfig.for_model("gemma3_text", sliding_window=512)) == 512
    assert sliding_window(AutoConfig.for_model("llama")) is None


def test_packing_a_model_with_chunked_attention_stops_with_one_line():
    """Llama-4's chunked layers attend within fixed chunks of the row, which a packed row would cut across examples."""
    from transformers import AutoConfig

    from tunebook.errors import ConfigError

    class Llama4Stub(torch.nn.Module):  # only the config is read; a real Llama-4 is too large to build here
        config = AutoConfig.for_model("llama4_text", num_hidden_layers=4, attention_chunk_size=256)

    Llama4Stub.config._attn_implementation = "sdpa"
    with pytest.raises(ConfigError, match=r"chunked attention \(chunks of 256 tokens\).*max_seq_length <= 256"):
        use_packed_attention(Llama4Stub(), "cpu", max_length=1024)
    assert use_packed_attention(Llama4Stub(), "cuda", max_length=256) == "sdpa"  # every example within one chunk


# Architectures whose code differs where packing could go wrong: learned absolute positions (GPT-2), partial rotary
# and parallel residual (GPT-NeoX), fused q/k/v (Phi-3), token routing (Qwen3-MoE), latent attention (DeepSeek-V3),
# query-key norms (OLMo-2), parallel blocks (Cohere), attention outside transformers' AttentionInterface (Falcon, which
# cannot be switched to per-example SDPA and keeps the mask), eager-only code with its own mask handling (GPT-J).
# Swept over transformers' causal LMs in float32; these are one of each kind.
ARCHITECTURES = {
    "gpt2": ("sdpa", {"n_positions": 64}),
    "gpt_neox": ("sdpa", {}),
    "phi3": ("sdpa", {}),
    "qwen3_moe": ("sdpa", {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "deepseek_v3": ("sdpa", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 1,
                             "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
                             "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "num_key_value_heads": 4}),
    "olmo2": ("sdpa", {}),
    "cohere": ("sdpa", {}),
    "falcon": ("sdpa", {"alibi": False, "new_decoder_architecture": False, "multi_query": True}),
    "gptj": ("eager", {"rotary_dim": 4, "n_positions": 64}),
}  # fmt: skip


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_packed_examples_stay_apart_in_every_architecture_and_backend(model_type):
    """Per-token logits inside packed rows equal each example's alone, on the backend packing picks on a CPU, on the
    block-diagonal mask (what sdpa keeps on CUDA) and on eager's additive mask."""
    attn, overrides = ARCHITECTURES[model_type]
    models = {"eager": _tiny_model(model_type, "eager", **overrides).eval()}
    if attn == "sdpa":
        models["sdpa"] = _tiny_model(model_type, "sdpa", **overrides).eval()
        picked = _tiny_model(model_type, "sdpa", **overrides).eval()
        models[use_packed_attention(picked, "cpu", max_length=24)] = picked  # per-example SDPA, or sdpa (Falcon)
    for backend, model in models.items():
        batch, seq_lengths = _packed_rows(attn=backend)
        with torch.no_grad():
            logits = model(**attention_inputs(batch, backend, torch.float32)).logits
            for in_row, alone in _logits_in_rows_and_alone(model, logits, batch, seq_lengths):
                torch.testing.assert_close(in_row, alone, atol=TOL, rtol=TOL, msg=lambda m, b=backend: f"{b}: {m}")


def test_falcon_is_not_given_per_example_inputs_it_would_ignore():
    """Falcon's attention is its own code, so the switch to per-example SDPA does not take: packing keeps sdpa and its
    mask. Given the per-example inputs anyway (cumulative lengths, no mask), as before this was checked, it lets every
    example attend to the ones packed before it."""
    model = _tiny_model("falcon", **ARCHITECTURES["falcon"][1]).eval()
    assert use_packed_attention(model, "cpu", max_length=24) == "sdpa"
    batch, seq_lengths = _packed_rows()
    with torch.no_grad():
        logits = model(**attention_inputs(batch, SEGMENT_SDPA, torch.float32)).logits
        worst = max((a - b).abs().max() for a, b in _logits_in_rows_and_alone(model, logits, batch, seq_lengths))
    assert worst > 1000 * TOL


# Models no packed-attention path keeps apart: layers with state along the row (convolution: LFM2; linear attention:
# Qwen3-Next; Mamba: Granite-4.0-H, Jamba), and code that accepts only a 2D padding mask (ALiBi from it: Falcon-RW,
# Bloom; GPT-1).
UNPACKABLE = {
    "lfm2": ({"layer_types": ["full_attention", "conv"], "full_attn_idxs": [0]}, r"recurrent layers \(conv"),
    "qwen3_next": ({"head_dim": 8, "layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 8,
                    "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
                    "num_experts_per_tok": 2}, r"recurrent layers \(linear_attention"),
    "granitemoehybrid": ({"layer_types": ["mamba", "attention"], "num_local_experts": 4, "num_experts_per_tok": 2,
                          "shared_intermediate_size": 32, "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_d_head": 16,
                          "mamba_chunk_size": 8}, "recurrent layers"),
    "jamba": ({"num_experts": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
               "expert_layer_offset": 1, "mamba_d_state": 8, "mamba_dt_rank": 4, "use_mamba_kernels": False},
              "recurrent layers"),
    "falcon": ({"alibi": True, "new_decoder_architecture": False, "multi_query": True}, "ALiBi"),
    "bloom": ({}, "ALiBi"),
    "openai-gpt": ({"n_positions": 64}, "only a 2D attention mask"),
}  # fmt: skip


@pytest.mark.parametrize("model_type", list(UNPACKABLE))
def test_packing_a_model_whose_examples_cannot_be_kept_apart_stops_with_one_line(model_type):
    from tunebook.errors import ConfigError

    overrides, what = UNPACKABLE[model_type]
    attn = "sdpa" if model_type not in ("bloom", "openai-gpt") else "eager"
    model = _tiny_model(model_type, attn, **overrides)
    with pytest.raises(ConfigError, match=rf"packing: \w+ .*{what}.*; set packing: false$"):
        use_packed_attention(model, "cuda", max_length=24)


def test_a_mamba_hybrid_packed_anyway_lets_examples_see_each_other():
    """What the check above prevents: a packed row through Granite-4.0-H's Mamba layers leaks across examples on every
    backend (the mask reaches its attention layers only)."""
    model = _tiny_model("granitemoehybrid", **UNPACKABLE["granitemoehybrid"][0]).eval()
    batch, seq_lengths = _packed_rows(attn="sdpa")
    with torch.no_grad():
        logits = model(**attention_inputs(batch, "sdpa", torch.float32)).logits
        worst = max((a - b).abs().max() for a, b in _logits_in_rows_and_alone(model, logits, batch, seq_lengths))
    assert worst > 1000 * TOL
