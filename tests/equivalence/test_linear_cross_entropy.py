"""The fused, chunked LM-head loss equals the loss on full logits, losses and every gradient (fp32, 1e-5), and never
materialises the (positions, vocab) logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tunebook.models.linear_ce as linear_ce
import tunebook.training.loss as loss_module
from tunebook.config import SFTConfig
from tunebook.data import PackedCollator, PadCollator, attention_inputs, use_packed_attention
from tunebook.models import apply_lora, build_causal_lm
from tunebook.models.linear_ce import linear_cross_entropy
from tunebook.training import causal_lm_token_losses, per_example_token_loss

TOL = 1e-5
CHUNK_ROWS = 7  # loss positions per chunk in these tests: several chunks and a remainder


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch, tiny_tokenizer):
    monkeypatch.setattr(linear_ce, "CHUNK_ELEMENTS", CHUNK_ROWS * len(tiny_tokenizer) + 3)
    monkeypatch.setattr(loss_module, "_CHANGES_LOGITS", set())


class _Strategy(list):
    """The vocabulary-sliced backwards run (their arguments), and the strategy asked for."""

    strategy = ""


@pytest.fixture(params=["rows", "vocab"])
def backward(request, monkeypatch) -> _Strategy:
    """Each backward strategy, forced (CPUs pick row chunks by themselves), and which one ran."""
    monkeypatch.setattr(linear_ce, "VOCAB_BACKWARD", request.param == "vocab")
    calls, vocab_backward = _Strategy(), linear_ce._vocab_backward
    calls.strategy = request.param
    monkeypatch.setattr(linear_ce, "_vocab_backward", lambda *args: calls.append(args) or vocab_backward(*args))
    return calls


def _rows(tokenizer, lengths, prompt=3):
    g = torch.Generator().manual_seed(1)
    rows = []
    for n in lengths:
        ids = torch.randint(10, len(tokenizer), (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def _batch(tokenizer, kind: str) -> dict:
    if kind == "padded":
        return PadCollator(tokenizer.pad_token_id, 8)(_rows(tokenizer, (5, 17, 11)))
    examples = _rows(tokenizer, (7, 9, 12, 6, 10))
    packs = []
    for group in ([0, 1, 2], [3, 4]):
        labels = [t for i in group for t in [-100] + examples[i]["labels"][1:]]  # the packer masks each first label
        ids = [t for i in group for t in examples[i]["input_ids"]]
        packs.append(
            {"input_ids": ids, "labels": labels, "seq_lengths": [len(examples[i]["input_ids"]) for i in group]}
        )
    return PackedCollator(tokenizer.pad_token_id, 8)(packs)


def _losses_and_grads(model, batch, attn, fused: bool):
    """Per-row loss sums and the gradients of a loss weighting each token by its row (as DPO's sequence sums do)."""
    model.zero_grad(set_to_none=True)
    inputs = attention_inputs(batch, attn, torch.float32)
    rows = len(batch["labels"])
    if fused:
        losses, positions = causal_lm_token_losses(model, inputs, batch)
        sums = torch.zeros(rows).index_add(0, positions // batch["labels"].shape[1], losses)
    else:
        sums = per_example_token_loss(model(**inputs).logits, batch["labels"])[0]
    (sums * torch.arange(1.0, rows + 1)).sum().div(100).backward()
    return sums.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _head_output_shapes(model) -> list:
    """Shapes the output layer returns from now on (the fused path returns one loss per position)."""
    shapes = []
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    return shapes


def _assert_equal_to_full_logits(model, batch, attn="sdpa", fused_head=True):
    shapes = _head_output_shapes(model)
    full_sums, full_grads = _losses_and_grads(model, batch, attn, fused=False)
    sums, grads = _losses_and_grads(model, batch, attn, fused=True)
    positions = batch["loss_positions"].numel()
    assert shapes[-1] == ((positions,) if fused_head else (positions, model.config.vocab_size))
    torch.testing.assert_close(sums, full_sums, atol=TOL, rtol=TOL)
    assert grads.keys() == full_grads.keys() and grads
    for name, grad in full_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=TOL, rtol=TOL, msg=f"gradient of {name}")


def test_chunked_function_equals_cross_entropy_of_linear(monkeypatch, backward):
    g = torch.Generator().manual_seed(0)
    vocab, rows = 301, 37  # neither a multiple of the 8-row chunks, nor of the vocabulary slices of 2408 // 37 = 65
    hidden = torch.randn(rows, 16, generator=g, requires_grad=True)
    weight = torch.randn(vocab, 16, generator=g, requires_grad=True)
    bias = torch.randn(vocab, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[:3] = torch.tensor([0, vocab - 1, 260])  # the first and the last slice's edges
    upstream = torch.rand(rows, generator=g)  # a different weight per token
    results = []
    for chunk_rows in (None, 8, rows):  # the plain loss; 8-row chunks; one chunk, whose softmax the backward keeps
        hidden.grad = weight.grad = bias.grad = None
        if chunk_rows:
            monkeypatch.setattr(linear_ce, "CHUNK_ELEMENTS", chunk_rows * vocab)
            losses = linear_cross_entropy(hidden, weight, bias, targets)
        else:
            losses = F.cross_entropy(F.linear(hidden, weight, bias), targets, reduction="none")
        (losses * upstream).sum().backward()
        results.append([losses.detach(), hidden.grad, weight.grad, bias.grad])
        if chunk_rows == 8:  # several chunks: the strategy asked for; one chunk keeps its softmax whatever it is
            assert len(backward) == (backward.strategy == "vocab")
    for fused in results[1:]:
        for got, expected in zip(fused, results[0]):
            torch.testing.assert_close(got, expected, atol=TOL, rtol=TOL)
    # The one-chunk softmax is changed in place by the backward: a second backward through it must fail, not reuse it.
    losses = linear_cross_entropy(hidden, weight, bias, targets)
    losses.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        losses.sum().backward()
    empty = linear_cross_entropy(hidden[:0], weight, None, targets[:0])
    empty.sum().backward()
    assert empty.shape == (0,) and empty.dtype == torch.float32


def test_vocabulary_slices_equal_cross_entropy_of_linear(monkeypatch):
    """The vocabulary-sliced backward: several row chunks in the forward, several slices in the backward, the last
    one partial and holding targets, a bias, per-sequence weights (as DPO's sums) with a sequence weighted 0, and
    each subset of the gradients asked for."""
    g = torch.Generator().manual_seed(2)
    vocab, rows, width = 203, 29, 12
    monkeypatch.setattr(linear_ce, "CHUNK_ELEMENTS", 6 * vocab)  # row chunks of 6; slices of 1218 // 29 = 42 columns
    monkeypatch.setattr(linear_ce, "VOCAB_BACKWARD", True)
    calls, vocab_backward = [], linear_ce._vocab_backward
    monkeypatch.setattr(linear_ce, "_vocab_backward", lambda *args: calls.append(args) or vocab_backward(*args))
    hidden, weight, bias = (
        torch.randn(rows, width, generator=g),
        torch.randn(vocab, width, generator=g),
        torch.randn(vocab, generator=g),
    )
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[:4] = torch.tensor([vocab - 1, 168, vocab - 2, 41])  # 168 opens the last slice, 41 closes the first
    sequence = torch.tensor([0] * 8 + [1] * 11 + [2] * 6 + [3] * 4)
    upstream = torch.tensor([1.0, -0.5, 0.0, 3.0])[sequence] / 7  # weight of each token: its sequence's
    for needed in [(True, True, True), (True, False, False), (False, True, True)]:
        inputs = [t.clone().requires_grad_(need) for t, need in zip((hidden, weight, bias), needed)]
        expected = F.cross_entropy(F.linear(*inputs), targets, reduction="none")
        expected_grads = torch.autograd.grad((expected * upstream).sum(), [t for t in inputs if t.requires_grad])
        losses = linear_cross_entropy(*inputs, targets)
        grads = torch.autograd.grad((losses * upstream).sum(), [t for t in inputs if t.requires_grad])
        torch.testing.assert_close(losses, expected, atol=TOL, rtol=TOL)
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    assert len(calls) == 3 and calls[0][4].shape == (rows,)  # run each time, with the forward's log-sum-exps


@pytest.mark.parametrize("autocast", [False, True])
def test_vocabulary_slices_in_bf16_agree_with_row_chunks(monkeypatch, autocast):
    """bf16 weights, or float32 ones under bf16 autocast: both strategies round differently (a float32 sum of bf16
    products per slice for the hidden states, per chunk for the weight), so they agree to bf16's precision."""
    g = torch.Generator().manual_seed(3)
    vocab, rows, width = 203, 29, 16
    monkeypatch.setattr(linear_ce, "CHUNK_ELEMENTS", 6 * vocab)
    dtype = torch.float32 if autocast else torch.bfloat16
    tensors = [
        torch.randn(rows, width, generator=g),
        torch.randn(vocab, width, generator=g) / 4,
        torch.randn(vocab, generator=g),
    ]
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[0] = vocab - 1
    upstream = torch.rand(rows, generator=g)
    calls, vocab_backward = [], linear_ce._vocab_backward
    monkeypatch.setattr(linear_ce, "_vocab_backward", lambda *args: calls.append(args) or vocab_backward(*args))
    results = {}
    for strategy in (False, True):
        monkeypatch.setattr(linear_ce, "VOCAB_BACKWARD", strategy)
        inputs = [t.to(dtype, copy=True).requires_grad_() for t in tensors]  # fresh leaves, fresh grads
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            losses = linear_cross_entropy(*inputs, targets)
        (losses * upstream).sum().backward()
        assert losses.dtype == torch.float32 and all(t.grad.dtype == dtype for t in inputs)
        results[strategy] = [losses.detach(), *(t.grad.float() for t in inputs)]
    assert len(calls) == 1
    torch.testing.assert_close(results[True][0], results[False][0], atol=0, rtol=0)  # one forward for both
    for got, want in zip(results[True][1:], results[False][1:]):  # gradients up to about 3: bf16's step there is 1/64
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)


def test_the_vocabulary_backward_is_automatic_on_cuda_only(monkeypatch):
    """None: vocabulary slices on CUDA where the vocabulary outnumbers the rows and the head is trained; CPUs and
    frozen heads (LoRA: no weight gradient to accumulate) keep row chunks."""
    assert linear_ce.VOCAB_BACKWARD is None
    assert linear_ce._slices_vocabulary("cuda", rows=16384, vocab=128256)
    assert not linear_ce._slices_vocabulary("cuda", rows=16384, vocab=128256, weight_grad=False)
    assert not linear_ce._slices_vocabulary("cuda", rows=16384, vocab=2048)
    assert not linear_ce._slices_vocabulary("cpu", rows=16384, vocab=128256)
    monkeypatch.setattr(linear_ce, "VOCAB_BACKWARD", True)
    assert linear_ce._slices_vocabulary("cpu", rows=16384, vocab=2048)
    monkeypatch.setattr(linear_ce, "VOCAB_BACKWARD", False)
    assert not linear_ce._slices_vocabulary("cuda", rows=16384, vocab=128256)


def test_bf16_weights_and_autocast_keep_float32_losses():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(37, 16, generator=g), torch.randn(301, 16, generator=g) / 4
    targets = torch.randint(0, 301, (37,), generator=g)
    expected = F.cross_entropy(F.linear(hidden, weight), targets, reduction="none")
    low = [hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()]
    losses = linear_cross_entropy(*low, None, targets)
    losses.sum().backward()
    assert losses.dtype == torch.float32 and low[1].grad.dtype == torch.bfloat16
    torch.testing.assert_close(losses, expected, atol=0.05, rtol=0.02)
    # Under autocast the matmuls run in bf16 as F.linear's would; the float32 weight gets a float32 gradient.
    full = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unfused = F.cross_entropy(F.linear(*full).float(), targets, reduction="none")
        losses = linear_cross_entropy(hidden, weight.requires_grad_(), None, targets)
    assert losses.dtype == torch.float32
    torch.testing.assert_close(losses, unfused, atol=1e-3, rtol=1e-3)
    losses.sum().backward()
    unfused.sum().backward()
    assert weight.grad.dtype == torch.float32
    torch.testing.assert_close(weight.grad, full[1].grad, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", ["padded", "packed"])
@pytest.mark.parametrize("tied", [False, True])
def test_fused_loss_equals_full_logits(tiny_tokenizer, tiny_model_config, kind, tied, backward):
    torch.manual_seed(0)
    model = build_causal_lm(tiny_tokenizer, model_config={**tiny_model_config, "tie_word_embeddings": tied}).train()
    batch = _batch(tiny_tokenizer, kind)
    assert batch["loss_positions"].numel() % CHUNK_ROWS
    attn = use_packed_attention(model, "cpu") if kind == "packed" else "sdpa"
    _assert_equal_to_full_logits(model, batch, attn)
    assert len(backward) == (backward.strategy == "vocab")


@pytest.mark.parametrize(
    "lora",
    [
        {},  # adapters in the body, the head frozen
        {"modules_to_save": ["lm_head"]},  # peft's ModulesToSaveWrapper: a trained copy of the head
        {"new_tokens": True},  # trainable_token_indices: the added tokens' rows train
        {"new_tokens": True, "tied": True},
    ],
)
def test_fused_loss_equals_full_logits_with_lora(tiny_tokenizer, tiny_model_config, lora, backward):
    torch.manual_seed(0)
    config = {**tiny_model_config, "tie_word_embeddings": lora.get("tied", False)}
    model = build_causal_lm(tiny_tokenizer, model_config=config)
    if lora.get("new_tokens"):
        model.new_token_rows = range(len(tiny_tokenizer) - 40, len(tiny_tokenizer))  # rows the targets hit
    settings = SFTConfig(
        use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, modules_to_save=lora.get("modules_to_save")
    )
    model = apply_lora(model, settings).train()
    for module in model.modules():  # peft starts LoRA B (and the token deltas) as no-ops: move them off it
        for name, param in module.named_parameters(recurse=False):
            if "lora_B" in name or "trainable_tokens_delta" in name:
                param.data.add_(torch.randn_like(param) * 0.1)
    batch = _batch(tiny_tokenizer, "padded")
    _assert_equal_to_full_logits(model, batch)
    assert len(backward) == (backward.strategy == "vocab")
    with torch.no_grad(), model.disable_adapter():  # DPO's reference: the frozen original head
        full = per_example_token_loss(model(**attention_inputs(batch, "sdpa", torch.float32)).logits, batch["labels"])
        losses, positions = causal_lm_token_losses(model, attention_inputs(batch, "sdpa", torch.float32), batch)
    sums = torch.zeros(len(batch["labels"])).index_add(0, positions // batch["labels"].shape[1], losses)
    torch.testing.assert_close(sums, full[0], atol=TOL, rtol=TOL)


def test_one_chunk_is_fused_lora_on_the_head_and_softcapped_logits_take_the_logits_path(
    tiny_tokenizer, tiny_model_config, monkeypatch
):
    torch.manual_seed(0)
    batch = _batch(tiny_tokenizer, "padded")
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config).train()
    monkeypatch.setattr(linear_ce, "CHUNK_ELEMENTS", batch["loss_positions"].numel() * len(tiny_tokenizer))
    _assert_equal_to_full_logits(model, batch)  # the logits fit in one chunk: fused, its softmax kept for backward
    monkeypatch.setattr(linear_ce, "CHUNK_ELEMENTS", CHUNK_ROWS * len(tiny_tokenizer))
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config)
    settings = SFTConfig(
        use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=["q_proj", "lm_head"]
    )
    _assert_equal_to_full_logits(
        apply_lora(model, settings).train(), _batch(tiny_tokenizer, "padded"), fused_head=False
    )
    gemma2 = {"model_type": "gemma2", "head_dim": 8, "final_logit_softcapping": 3.0, "attn_logit_softcapping": None}
    model = build_causal_lm(tiny_tokenizer, model_config={**tiny_model_config, **gemma2}).train()
    _assert_equal_to_full_logits(model, _batch(tiny_tokenizer, "padded"), fused_head=False)


def test_logits_changed_after_the_head_are_found_and_recomputed(tiny_tokenizer, tiny_model_config, caplog):
    torch.manual_seed(0)
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config).train()

    def halve_logits(module, args, kwargs, output):  # as an unknown model's logit scale would
        output.logits = output.logits / 2
        return output

    model.register_forward_hook(halve_logits, with_kwargs=True)
    batch = _batch(tiny_tokenizer, "padded")
    full_sums, full_grads = _losses_and_grads(model, batch, "sdpa", fused=False)
    sums, grads = _losses_and_grads(model, batch, "sdpa", fused=True)
    assert "changes its logits after the output layer" in caplog.text
    assert loss_module._CHANGES_LOGITS == {"llama"}  # and the next batches go straight to the logits path
    torch.testing.assert_close(sums, full_sums, atol=TOL, rtol=TOL)
    for name, grad in full_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=TOL, rtol=TOL, msg=f"gradient of {name}")


def test_falcon_h1s_head_multiplier_takes_the_logits_path_without_a_second_forward(
    tiny_tokenizer, tiny_model_config, caplog
):
    """Falcon-H1 multiplies the logits after the head (`lm_head_multiplier`, always set): known from its config, so
    no batch is run fused first, found changed and run again."""
    torch.manual_seed(0)
    falcon_h1 = {"model_type": "falcon_h1", "head_dim": 8, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16,
                 "mamba_d_state": 8, "mamba_chunk_size": 8, "lm_head_multiplier": 0.5}  # fmt: skip
    model = build_causal_lm(tiny_tokenizer, model_config={**tiny_model_config, **falcon_h1}).train()
    _assert_equal_to_full_logits(model, _batch(tiny_tokenizer, "padded"), fused_head=False)
    assert "not fused" not in caplog.text and not loss_module._CHANGES_LOGITS


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_model_that_fails_on_fused_losses_gets_its_logits(tiny_tokenizer, tiny_model_config, mode, caplog):
    """A model that works on its logits inside its forward (xLSTM reads their length in evaluation) breaks on the
    fused head's one loss per position: that batch is run again with logits, and so are the next ones."""
    torch.manual_seed(0)
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config).train(mode == "train")

    def read_length(module, args, output):
        assert output.shape[1] > 0  # an IndexError on losses, as in xLSTM's forward
        return output

    model.get_output_embeddings().register_forward_hook(read_length)
    batch = _batch(tiny_tokenizer, "padded")
    with torch.set_grad_enabled(mode == "train"):
        losses, positions = causal_lm_token_losses(model, attention_inputs(batch, "sdpa", torch.float32), batch)
        full = per_example_token_loss(model(**attention_inputs(batch, "sdpa", torch.float32)).logits, batch["labels"])
    assert "fails on fused losses from its output layer" in caplog.text
    assert loss_module._CHANGES_LOGITS == {"llama"}
    sums = torch.zeros(len(batch["labels"])).index_add(0, positions // batch["labels"].shape[1], losses)
    torch.testing.assert_close(sums, full[0], atol=TOL, rtol=TOL)


def _peak_rss_growth(fn) -> int:
    """Bytes the process's resident set grew by at its peak while `fn` ran (Linux: VmHWM reset via clear_refs)."""

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    start = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    return status("VmHWM") - start


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="peak RSS reset is Linux-only")
def test_full_logits_are_never_materialised(tiny_tokenizer, tiny_model_config, monkeypatch):
    """A 131,072-token vocabulary and 1,024 loss positions: the logits would take 512 MiB."""
    monkeypatch.setattr(linear_ce, "CHUNK_ELEMENTS", 2**22)  # 16 MiB chunks
    torch.manual_seed(0)
    config = {**tiny_model_config, "vocab_size": 131072, "hidden_size": 16, "num_attention_heads": 2}
    model = build_causal_lm(tiny_tokenizer, model_config=config).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 131072, (4, 257), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    logits_bytes = 4 * 256 * 131072 * 4
    shapes = _head_output_shapes(model)

    def step():
        causal_lm_token_losses(model, {"input_ids": ids, "attention_mask": batch["attention_mask"]}, batch)[
            0
        ].sum().backward()

    step()  # first use: weight gradients and allocator pools
    assert shapes[-1] == (1024,)
    assert _peak_rss_growth(step) < logits_bytes / 4
    monkeypatch.setattr(
        loss_module, "fusable_output_layer", lambda *args: False
    )  # the selected-logits path, for scale
    assert _peak_rss_growth(step) > logits_bytes
