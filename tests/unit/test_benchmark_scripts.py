"""The GPU benchmarks' bookkeeping, without a GPU: gpu/gpu_vs_peers.py's steady-state clock read from Tunebook's logging
windows, micro-batch plan, override filter, out-of-memory retry and the table's goal verdicts; packed_attention.py's
table rebuilt from its records. (The end-to-end checks are the scripts' `--smoke` runs, minutes on the CPU.)"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    # The GPU scripts live in benchmarks/gpu/ and import results.py from benchmarks/.
    paths = [str(BENCHMARKS / "gpu"), str(BENCHMARKS)]
    before = list(sys.path)
    sys.path[:0] = paths
    try:
        yield importlib.import_module("gpu_vs_peers")
    finally:
        sys.path[:] = before


def test_tunebook_figures_time_only_the_windows_after_warmup(bench, tmp_path):
    # Windows of 10 steps: a slow first one (start-up), then 1000 tokens per 2 s, then per 1 s.
    windows = [
        {"step": 10, "train_tokens": 1000, "tokens_per_second": 10.0},
        {"step": 20, "train_tokens": 2000, "tokens_per_second": 500.0},
        {"step": 30, "train_tokens": 3000, "tokens_per_second": 1000.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(w) + "\n" for w in [{"step": 0}, *windows]))
    summary = {"train_tokens": 3000, "train_steps": 30, "final_train_loss": 2.5, "peak_device_memory_mb": 1024.0}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    figures = bench.tunebook_figures(tmp_path, warmup=10)
    assert figures["tokens_per_second"] == pytest.approx(2000 / 3)  # 2000 tokens in 2 + 1 seconds
    assert figures["tokens_per_step"] == 100 and figures["final_loss"] == 2.5 and figures["peak_memory_mb"] == 1024


def test_plan_gives_every_system_about_the_same_examples_per_step(bench, monkeypatch):
    monkeypatch.setattr(bench, "flops_per_token", lambda *a: 1.0)
    stats = {"mean": 150.0, "p95": 400.0}
    run = bench.plan_run("x", bench.Shape({}, 8192, 2), 2048, stats)
    assert run["rows"] == 4 and run["micro_examples"] == round(8192 / 150)
    assert run["pad_examples"] == 20  # 20 x 400 <= 8192
    examples = run["micro_examples"] * run["accumulation"]
    assert abs(run["pad_examples"] * run["pad_accumulation"] - examples) <= run["pad_examples"] / 2


def test_unknown_tunebook_overrides_are_dropped(bench, capsys):
    kept = bench.tunebook_overrides("--learning_rate 1e-4 --no_such_key true --seed=3")
    assert kept == ["--learning_rate", "1e-4", "--seed=3"]
    assert "no_such_key" in capsys.readouterr().out


def _record(system, tokens_per_second, memory_mb, status="ok", shape="Llama-3.2-1B", mfu=0.5):
    return {"shape": shape, "seq_len": 2048, "system": system, "status": status, "micro_batches": "4 rows x 2",
            "tokens_per_second": tokens_per_second, "tokens_per_step": 16000, "mfu": mfu, "final_loss": 3.0,
            "peak_memory_mb": memory_mb, "wall_seconds": 60, "device": "NVIDIA H100 80GB HBM3", "machine": "m",
            "versions": "v", "command": "python benchmarks/gpu_vs_peers.py", "tunebook_args": "",
            "peer_training_args": "{}"}  # fmt: skip


def test_goals_compare_with_the_faster_trainer_and_memory(bench):
    records = [_record("tunebook", 30000, 20000), _record("trainer_pad", 10000, 30000),
               _record("trainer_flat", 19000, 25000), _record("trl", 15000, 22000, status="oom")]  # fmt: skip
    text = bench.table(records)
    assert "1.58x the tokens/s of the faster Trainer (Trainer, DataCollatorWithFlattening)" in text
    assert "goal >= 1.5x at equal or lower memory: met" in text
    assert "MFU 50.0% (goal >= 45%: met)" in text
    assert "| TRL SFTTrainer, packing (bfd, padding-free) | 4 rows x 2 | out of memory |" in text
    more_memory = bench.table([_record("tunebook", 30000, 26000), _record("trainer_flat", 19000, 25000)])
    assert "equal or lower memory: not met" in more_memory


def test_tunebook_runs_with_overrides_are_rows_of_their_own_with_their_own_verdicts(bench):
    compiled = {**_record("tunebook", 20000, 18000, mfu=0.3), "tunebook_args": "--torch_compile true"}
    text = bench.table([_record("tunebook", 30000, 20000), compiled, _record("trainer_flat", 19000, 25000)])
    assert "| Tunebook SFT, packing | 4 rows x 2 | 16,000 | 30,000 |" in text
    assert "| Tunebook SFT, packing + `--torch_compile true` | 4 rows x 2 | 16,000 | 20,000 |" in text
    assert "Tunebook: 1.58x" in text and "Tunebook + `--torch_compile true`: 1.05x" in text
    assert "MFU 30.0% (goal >= 45%: not met)" in text


def test_runs_without_cudnn_attention_are_rows_of_their_own(bench):
    plain = _record("tunebook", 30000, 20000)
    no_cudnn = {**_record("tunebook", 25000, 20000), "sdpa": bench.NO_CUDNN}
    compiled = {**no_cudnn, "tunebook_args": "--torch_compile true"}
    peer = _record("trainer_flat", 19000, 25000)
    text = bench.table([plain, no_cudnn, compiled, {**peer, "sdpa": bench.NO_CUDNN, "tokens_per_second": 18000}])
    assert "| Tunebook SFT, packing | 4 rows x 2 | 16,000 | 30,000 |" in text
    assert "| Tunebook SFT, packing, no cuDNN attention | 4 rows x 2 | 16,000 | 25,000 |" in text
    assert "| Tunebook SFT, packing + `--torch_compile true`, no cuDNN attention | 4 rows x 2 |" in text
    assert "| Trainer, DataCollatorWithFlattening, no cuDNN attention |" in text
    assert "Tunebook, no cuDNN attention: 1.39x" in text  # against the Trainer's run without cuDNN's attention
    assert "Tunebook: MFU 50.0%" in text  # like with like: no Trainer run with the default kernels here
    assert len({bench.system_key(r) for r in (plain, no_cudnn, compiled)}) == 3


def test_an_out_of_memory_run_is_retried_with_half_the_micro_batch_and_twice_the_accumulation(bench):
    run = {"rows": 4, "accumulation": 2, "micro_examples": 87, "pad_examples": 41, "pad_accumulation": 4}
    assert bench.halve("trainer_pad", run) == {**run, "pad_examples": 20, "pad_accumulation": 8}
    assert bench.halve("trainer_flat", run) == {**run, "micro_examples": 43, "accumulation": 4}
    assert bench.halve("tunebook", run) == {**run, "rows": 2, "accumulation": 4}
    assert bench.halve("trl", {**run, "rows": 1}) is None  # one row is as small as it gets


def test_packed_attention_table_is_rebuilt_from_its_records_with_the_profiles():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        packed = importlib.import_module("packed_attention")
    finally:
        sys.path.remove(str(BENCHMARKS))
    context = {"device": "cuda", "machine": "H100 box", "versions": "torch 2.11", "command": "python3 x.py",
               "setup": "cuda, bf16"}  # fmt: skip
    step = {**context, "shape": "Llama-3.2-1B", "seq_len": 2048, "rows": 8, "attn": "sdpa", "examples_per_row": 12.75,
            "step_ms": 526.2, "step_ms_range": [525.0, 527.0], "tokens_per_second": 31108.0,
            "peak_memory_mb": 44107.0, "loss": 12.17144,
            "profile": {"total_ms": 500.0, "lm_head_ms": 100.0,
                        "ops": [["aten::mm", 250.0, 300], ["aten::mul", 50.0, 900]]}}  # fmt: skip
    mask = {**context, "shape": "Llama-3.2-1B", "seq_len": 2048, "rows": 8,
            "mask": {"tiles_from_boundaries_cpu_ms": 0.2, "create_block_mask_cuda_ms": 5.5}}  # fmt: skip
    text = packed.table([step, mask])
    assert "- Machine: H100 box" in text and "- Command: `python3 x.py`" in text
    assert "| Llama-3.2-1B | 2048 | 8 | 12.8 | sdpa | 526.2 (525.0-527.0) | 31,108 | 44107 | 12.17144 |" in text
    assert "- Llama-3.2-1B, 8 x 2048: tiles from boundaries cpu 0.20, create block mask cuda 5.50" in text
    assert (
        "- Llama-3.2-1B, 8 x 2048, sdpa (500 ms, of which 100 ms (20%) with the vocabulary): aten::mm 250.0 "
        "(50%); aten::mul 50.0 (10%)"
    ) in text
