"""Packed examples must not see each other: every token's loss inside a packed row equals its loss alone.

Checked per attention backend, in training and in evaluation mode, in float32 to 1e-5. The last test shows the
comparison is sensitive: a packed row given a plain 2D attention mask (what transformers does with a padded
batch) lets examples attend across their boundaries and fails it by orders of magnitude.
"""

from __future__ import annotations

import datasets
import pytest
import torch
import torch.nn.functional as F

from tunebook.data.collate import PackedCollator
from tunebook.data.packing import SEGMENT_SDPA, attention_inputs, pack_dataset, use_packed_attention
from tunebook.models import build_causal_lm

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


# Tiny models with sliding-window layers, in the shapes users bring: every layer windowed (Mistral), windowed layers
# after full ones (Qwen2 with use_sliding_window), local and global layers interleaved (Gemma-3). Window 4 tokens,
# examples of 3 to 13: most examples are longer than the window.
SLIDING = {
    "mistral": {"sliding_window": 4},
    "qwen2": {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1},
    "gemma3_text": {"sliding_window": 4, "head_dim": 8, "layer_types": ["sliding_attention", "full_attention"]},
}


def _sliding_model(model_type: str, attn: str = "sdpa"):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                  **SLIDING[model_type])  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


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
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 100, (n,), generator=g).tolist() for n in LENGTHS]
    packed, _ = pack_dataset(datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}), 24, seed=0)
    batch = {k: v.to(device) for k, v in PackedCollator(0, 8, SEGMENT_SDPA)(list(packed)).items()}
    with torch.no_grad():
        logits = model(**attention_inputs(batch, SEGMENT_SDPA, torch.float32)).logits
        model.set_attn_implementation("sdpa")
        unwindowed = model(**attention_inputs(batch, "sdpa", torch.float32)).logits
        worst_unwindowed = 0.0
        for row in range(len(packed)):
            start = 0
            for n in packed[row]["seq_lengths"]:
                alone_ids = batch["input_ids"][row : row + 1, start : start + n]
                alone = model(input_ids=alone_ids, use_cache=False).logits[0]
                torch.testing.assert_close(logits[row, start : start + n], alone, atol=tol, rtol=tol)
                worst_unwindowed = max(worst_unwindowed, (unwindowed[row, start : start + n] - alone).abs().max())
                start += n
    assert worst_unwindowed > 1000 * tol


@pytest.mark.parametrize("attn", ["eager", "flex_attention"])
def test_packing_a_sliding_window_model_with_one_mask_for_every_layer_stops_with_one_line(attn):
    from tunebook.errors import ConfigError

    model = _sliding_model("gemma3_text", attn)
    with pytest.raises(ConfigError, match=r"sliding-window attention \(window 4 < max_seq_length 24\).*use "
                                          "attn_implementation sdpa or flash_attention_2, or packing: false"):  # fmt: skip
        use_packed_attention(model, "cuda", max_length=24)
    # A window no example can outgrow changes nothing: the backend stays.
    assert use_packed_attention(model, "cuda", max_length=4) == attn


def test_sliding_window_is_read_from_the_config_only_where_layers_use_it():
    from transformers import AutoConfig

    from tunebook.data.packing import sliding_window

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
