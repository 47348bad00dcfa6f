"""Regional compilation (torch_compile): the blocks compile in place, and with LoRA and gradient checkpointing the
compiled model's loss and gradients equal the eager model's; evaluation runs eagerly."""

from __future__ import annotations

import copy

import pytest
import torch

from tunebook.config import SFTConfig
from tunebook.data.collate import PackedCollator
from tunebook.errors import ConfigError
from tunebook.models import apply_lora, build_causal_lm
from tunebook.models.attention import attention_inputs, use_packed_attention
from tunebook.training.compilation import compile_blocks, eager, transformer_blocks

pytestmark = pytest.mark.slow  # a first compile takes ~10 s on 2 cores


def _loss(model, batch):
    return model(**batch).loss


@pytest.mark.parametrize("lora", [False, True])
def test_compiled_blocks_give_eager_loss_and_gradients(tiny_tokenizer, tiny_model_config, lora):
    torch.manual_seed(0)
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config, gradient_checkpointing=True)
    if lora:
        model = apply_lora(model, SFTConfig(use_peft=True, lora_r=4, lora_dropout=0.0))
    model.train()
    compiled = copy.deepcopy(model)
    names = [n for n, _ in compiled.named_parameters()]
    blocks = compile_blocks(compiled)
    assert blocks.blocks == 2 and blocks.block_class == "LlamaDecoderLayer"
    assert [n for n, _ in compiled.named_parameters()] == names  # checkpoints and saved models keep their keys

    texts = ["Reverse the digits.\n1234 4321", "hello world, two plus two"]
    for length in (None, 24):  # two lengths: one dynamic graph serves both
        batch = dict(tiny_tokenizer(texts, padding="max_length" if length else True, max_length=length,
                                    return_tensors="pt"))  # fmt: skip
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        expected, got = _loss(model, batch), _loss(compiled, batch)
        expected.backward()
        got.backward()
        assert got.item() == pytest.approx(expected.item(), abs=1e-5)
        for (name, p), q in zip(model.named_parameters(), compiled.parameters()):
            if p.grad is not None:
                torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
        model.zero_grad()
        compiled.zero_grad()
        blocks.step_done()
    assert blocks.recompiles == 0 and blocks.graphs >= 1

    before = blocks.graphs
    with torch.no_grad(), eager():  # inference would compile graphs of its own
        compiled.eval()(**batch)
    assert blocks.graphs == before


def test_each_run_in_a_process_compiles_its_blocks_afresh(tiny_tokenizer, tiny_model_config, monkeypatch):
    """A notebook trains many models in one process: past dynamo's recompile limit (8 graphs of one code object) a
    block would run eagerly, and the run report 0 graphs. Nine models whose shapes differ each get their own graph."""
    from torch._dynamo import config as dynamo_config

    from tunebook.training import compilation

    monkeypatch.setattr(compilation, "BACKEND", "eager")  # dynamo's graphs without inductor's code: fast
    ids = torch.randint(10, len(tiny_tokenizer), (1, 12), generator=torch.Generator().manual_seed(0))
    for width in range(1, dynamo_config.recompile_limit + 2):
        model = build_causal_lm(tiny_tokenizer, model_config={**tiny_model_config, "hidden_size": 8 * width,
                                                              "intermediate_size": 16 * width})  # fmt: skip
        blocks = compile_blocks(model, static=True)
        model(input_ids=ids, labels=ids).loss.backward()
        blocks.step_done()
        assert blocks.graphs >= 1, f"model {width}: no graph compiled"


def test_packed_batches_of_one_shape_keep_one_static_graph(tiny_tokenizer, tiny_model_config):
    """Packed batches of one shape (what torch_compile's runs get) compile static graphs once: batches holding another
    number of examples, or fewer rows (filled up with padding), do not recompile; the loss equals eager's on the
    rows as they came."""
    torch.manual_seed(0)
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config)
    attn = use_packed_attention(model, "cpu", max_length=32)  # per-example attention, given the example boundaries
    model.train()
    compiled = copy.deepcopy(model)
    blocks = compile_blocks(compiled, static=True)
    plain = PackedCollator(tiny_tokenizer.pad_token_id, pad_to_multiple_of=8, attn_implementation=attn)
    fixed = PackedCollator(tiny_tokenizer.pad_token_id, pad_to_multiple_of=8, attn_implementation=attn,
                           row_length=32, rows=2)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for example_lengths in ([[10, 12], [30]], [[5, 6, 7], [8, 9, 3, 4]], [[20, 9]]):
        rows = []
        for lengths in example_lengths:
            ids = torch.randint(3, 300, (sum(lengths),), generator=g).tolist()
            rows.append({"input_ids": ids, "labels": ids, "seq_lengths": lengths})
        batch = fixed(rows)
        assert batch["input_ids"].shape == (2, 32)  # not the longest row rounded up, nor fewer rows
        inputs = {**attention_inputs(batch, attn, torch.float32), "labels": batch["labels"]}
        as_they_came = plain(rows)
        expected = _loss(
            model, {**attention_inputs(as_they_came, attn, torch.float32), "labels": as_they_came["labels"]}
        )
        got = _loss(compiled, inputs)
        assert got.item() == pytest.approx(expected.item(), abs=1e-5)
        got.backward()
        blocks.step_done()
    assert blocks.recompiles == 0


def test_a_model_without_repeated_blocks_is_refused():
    assert transformer_blocks(torch.nn.Linear(2, 2)) == []
    with pytest.raises(ConfigError, match="torch_compile: no transformer blocks found in Linear"):
        compile_blocks(torch.nn.Linear(2, 2))
