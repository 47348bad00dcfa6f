"""`torch_compile: auto` compiles only where it was measured to pay back; true and false are followed as given."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from tunebook.config import ConfigError, SFTConfig, load_config
from tunebook.training import compilation
from tunebook.training.compilation import AUTO_MIN_MICRO_BATCHES, should_compile

CUDA = SimpleNamespace(device=torch.device("cuda", 0), distributed_type=DistributedType.NO)
ENOUGH = AUTO_MIN_MICRO_BATCHES


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setattr(compilation, "has_triton", lambda: True)


def test_auto_compiles_long_packed_runs_on_cuda():
    compiled, why = should_compile(SFTConfig(), CUDA, static=True, micro_batches=ENOUGH)
    assert SFTConfig().torch_compile == "auto"
    assert compiled and why == f"torch_compile auto: on (CUDA, batches of one shape, {ENOUGH:,} micro-batches)"


@pytest.mark.parametrize(
    ("settings", "accelerator", "static", "micro_batches", "reason"),
    [
        ({}, SimpleNamespace(device=torch.device("cpu"), distributed_type=DistributedType.NO), True, ENOUGH,
         "on cpu, where the first compile pays back only on long runs: set torch_compile: true for those"),
        ({}, CUDA, False, ENOUGH, "batches change shape (padding), where dynamic graphs ran slower than eager"),
        ({}, SimpleNamespace(device=torch.device("cuda", 0), distributed_type=DistributedType.DEEPSPEED), True,
         ENOUGH, "compiled blocks are not tested under DeepSpeed"),
        ({"use_liger_kernel": True}, CUDA, True, ENOUGH, "Liger's kernels already fuse the blocks' layers"),
        ({"load_in_4bit": True}, CUDA, True, ENOUGH, "bitsandbytes' 4-bit layers"),
        ({}, CUDA, True, ENOUGH - 1,
         f"{ENOUGH - 1:,} micro-batches, fewer than the {ENOUGH:,} that pay the first compile back"),
    ],
)  # fmt: skip
def test_auto_stays_eager_where_compiling_was_not_measured_to_pay(settings, accelerator, static, micro_batches,
                                                                  reason):  # fmt: skip
    config = SFTConfig()
    for key, value in settings.items():  # set after the checks: load_in_4bit alone asks for a pretrained model
        setattr(config, key, value)
    assert should_compile(config, accelerator, static, micro_batches) == (False, f"torch_compile auto: off ({reason})")


def test_auto_without_triton_stays_eager(monkeypatch):
    monkeypatch.setattr(compilation, "has_triton", lambda: False)
    assert should_compile(SFTConfig(), CUDA, True, ENOUGH) == (
        False, "torch_compile auto: off (no Triton for inductor's CUDA kernels)")  # fmt: skip


@pytest.mark.parametrize("value", [True, False])
def test_true_and_false_are_followed_anywhere(value):
    cpu = SimpleNamespace(device=torch.device("cpu"), distributed_type=DistributedType.NO)
    assert should_compile(SFTConfig(torch_compile=value), cpu, static=False, micro_batches=1)[0] is value


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], "auto"), (["--torch_compile", "auto"], "auto"), (["--torch_compile"], True), (["--no_torch_compile"], False),
     (["--torch_compile", "true"], True), (["--torch_compile=false"], False)],
)  # fmt: skip
def test_torch_compile_reads_true_false_and_auto(argv, expected):
    assert load_config(SFTConfig, argv).torch_compile == expected


def test_another_torch_compile_value_stops_with_one_line():
    with pytest.raises(ConfigError, match="torch_compile.*sometimes"):
        load_config(SFTConfig, ["--torch_compile", "sometimes"])


@pytest.mark.parametrize("fallback", [True, False])
def test_under_auto_blocks_that_fail_to_compile_run_eagerly(tiny_tokenizer, tiny_model_config, monkeypatch, caplog,
                                                            request, fallback):  # fmt: skip
    """auto (`fallback`): a block whose compile fails runs its eager forward, with a warning, where the run would
    otherwise stop; `torch_compile: true` stops with the compiler's error."""
    import torch._dynamo

    from tunebook.models import build_causal_lm
    from tunebook.training.compilation import compile_blocks

    def failing_backend(graph, example_inputs):
        raise RuntimeError("no kernels for this block")

    torch._dynamo.reset()
    request.addfinalizer(torch._dynamo.reset)  # the failed code is marked to skip: later tests compile it afresh
    monkeypatch.setattr(compilation, "BACKEND", failing_backend)
    torch.manual_seed(0)
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config).train()
    batch = dict(tiny_tokenizer(["hello world, two plus two"], return_tensors="pt"))
    batch["labels"] = batch["input_ids"]
    expected = model(**batch).loss
    with torch._dynamo.config.patch(suppress_errors=False):  # as a caller's process may have it
        blocks = compile_blocks(model, static=True, fallback=fallback)
        if not fallback:
            with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="no kernels for this block"):
                model(**batch)
            return
        loss = model(**batch).loss
        loss.backward()
        assert torch._dynamo.config.suppress_errors is False  # set only while a compiled block runs
    with caplog.at_level("WARNING", logger="tunebook"):
        blocks.step_done()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6) and blocks.failures > 0
    assert "torch_compile auto: LlamaDecoderLayer code failed to compile" in caplog.text
