"""On a CUDA GPU: the recipe under FSDP2 (fsdp.yaml), DeepSpeed ZeRO-2/3 and plain single-GPU, one process, bf16, trains, saves a full Hugging Face
model from the sharded state, writes sharded checkpoints, and a run resumed from one continues the same run.

Skipped without CUDA (CI has none); run on a GPU machine with `pytest -m gpu`. Resumption is compared with a
tolerance, not bit for bit as on the CPU: CUDA's attention backward accumulates in a nondeterministic order.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support import TINY_TEST_MODEL, launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
COMMON = [
    "--model_config", json.dumps(TINY_TEST_MODEL),
    *"""--disable_tqdm true --synthetic_train_size 80 --synthetic_eval_size 8 --max_steps 6 --logging_steps 1
    --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --eval_on_start false --generation_eval false
    --save_steps 3 --save_total_limit 0 --learning_rate 2e-3 --report_to none --packing true
    --max_seq_length 64""".split(),
]  # fmt: skip
ONE_PROCESS = ("--num_processes", "1")


def _losses(out):
    return {
        r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    }


def _resume_from_step_3(tmp_path, full, args, accelerate_config):
    """Resume a copy of run `full` from its step-3 checkpoint; steps 4-6 must log the same losses (2e-3)."""
    run = tmp_path / "resumed"
    shutil.copytree(full, run)
    shutil.rmtree(run / "checkpoints" / "step-6")
    resume = [*args, "--output_dir", str(run), "--resume_from_checkpoint", "latest"]
    result = launch("recipes/sft.py", resume, accelerate_config, launcher_args=ONE_PROCESS)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    reference, resumed = _losses(full), _losses(run)
    assert sorted(resumed) == list(range(1, 7))
    assert [resumed[s] for s in range(4, 7)] == pytest.approx([reference[s] for s in range(4, 7)], rel=2e-3)
    return run


def _deepspeed_runs(config):
    """`config` as a test parameter, skipped where DeepSpeed is not installed."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return pytest.param(config, marks=pytest.mark.skip(reason="deepspeed is not installed"))
    return config


@pytest.mark.parametrize(
    "accelerate_config",
    ["fsdp.yaml", "single_gpu.yaml", _deepspeed_runs("deepspeed_zero2.yaml"), _deepspeed_runs("deepspeed_zero3.yaml")],
)
def test_gpu_engine_trains_saves_and_resumes(tmp_path, accelerate_config):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    full = tmp_path / "full"
    result = launch(
        "recipes/sft.py", [*COMMON, "--output_dir", str(full)], accelerate_config, launcher_args=ONE_PROCESS
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    engine = {"fsdp.yaml": "FSDP", "single_gpu.yaml": "NO"}.get(accelerate_config, "DEEPSPEED")
    setup = {"fsdp.yaml": "FSDP2, 1 process", "single_gpu.yaml": "single process"}.get(
        accelerate_config, f"DeepSpeed ZeRO-{accelerate_config[-6]}, 1 process"
    )
    assert f"Launch: {setup} on cuda, bf16 mixed precision" in result.stdout
    summary = json.loads((full / "summary.json").read_text())
    assert summary["mixed_precision"] == "bf16" and summary["peak_device_memory_mb"] > 0 and summary["mfu"] > 0
    if engine == "FSDP":  # the checkpoint holds the sharded state (distributed checkpoint files)
        assert any("fsdp" in p.name for p in (full / "checkpoints" / "step-3").iterdir())
    model = AutoModelForCausalLM.from_pretrained(full)  # a full model directory gathered from the shards
    assert model.config.num_hidden_layers == TINY_TEST_MODEL["num_hidden_layers"]

    run = _resume_from_step_3(tmp_path, full, COMMON, accelerate_config)
    a, b = load_file(full / "model.safetensors"), load_file(run / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=2e-3, rtol=2e-3, msg=f"parameter {name}")


@pytest.mark.parametrize("accelerate_config", ["single_gpu.yaml", "fsdp.yaml"])
def test_gpu_lora_trains_saves_adapters_and_resumes(tmp_path, accelerate_config):
    """LoRA in bf16 on one GPU and under FSDP2: adapter-only checkpoints, an adapter directory, the same resumed run."""
    pytest.importorskip("peft")
    from tunebook.models import load_adapter_model

    args = [*COMMON, "--use_peft", "true", "--gradient_checkpointing", "true"]
    full = tmp_path / "full"
    result = launch("recipes/sft.py", [*args, "--output_dir", str(full)], accelerate_config, launcher_args=ONE_PROCESS)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert (full / "checkpoints/step-3/adapter/adapter_model.safetensors").is_file()
    load_adapter_model(full)
    _resume_from_step_3(tmp_path, full, args, accelerate_config)


def test_gpu_qlora_trains_4bit_base(tmp_path, tiny_tokenizer, tiny_model_config):
    """QLoRA: a saved tiny model loaded in 4-bit NF4 through bitsandbytes trains LoRA adapters on one GPU."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from tunebook.models import build_causal_lm

    base = tmp_path / "base"
    build_causal_lm(tiny_tokenizer, model_config=tiny_model_config).save_pretrained(base)
    tiny_tokenizer.save_pretrained(base)
    args = [*COMMON[2:], "--model_name_or_path", str(base), "--use_peft", "true", "--load_in_4bit", "true"]
    out = tmp_path / "qlora"
    result = launch("recipes/sft.py", [*args, "--output_dir", str(out)], "single_gpu.yaml", launcher_args=ONE_PROCESS)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert (out / "adapter_model.safetensors").is_file()
    assert json.loads((out / "summary.json").read_text())["trainable_parameters"] > 0


def test_gpu_fp16_loss_scaling_skips_overflows_and_trains(tmp_path):
    """fp16 mixed precision with CUDA's GradScaler: overflowing steps are skipped and counted, the run ends, no NaN in
    the weights (the CPU test in tests/recipes/test_guarantees.py runs the same loop with torch's CPU GradScaler)."""
    from safetensors.torch import load_file

    out = tmp_path / "fp16"
    result = launch("recipes/sft.py", [*COMMON, "--output_dir", str(out)], "single_gpu.yaml",
                    launcher_args=(*ONE_PROCESS, "--mixed_precision", "fp16"))  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mixed_precision"] == "fp16" and summary["train_steps"] == 6
    assert summary["skipped_updates"] < 6 and summary["final_train_loss"] is not None
    assert all(torch.isfinite(w).all() for w in load_file(out / "model.safetensors").values())


@pytest.mark.parametrize("accelerate_config", ["single_gpu.yaml", "fsdp.yaml"])
def test_gpu_compiled_blocks_train_as_eager_does(tmp_path, accelerate_config):
    """torch_compile on CUDA, alone and under FSDP2 (its all-gather hooks stay outside the compiled blocks): packed
    rows compile static graphs once, and the 6 steps log eager's losses (2e-2: bf16, and compiled kernels round
    differently)."""
    losses = {}
    for compiled in (False, True):
        out = tmp_path / f"compiled-{compiled}"
        args = [*COMMON, "--torch_compile", str(compiled).lower(), "--output_dir", str(out)]
        result = launch("recipes/sft.py", args, accelerate_config, launcher_args=ONE_PROCESS)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        losses[compiled] = _losses(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["torch_compile_shapes"] == "static" and summary["torch_compile_recompiles"] == 0
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)


@pytest.mark.parametrize("accelerate_config", ["fsdp.yaml", _deepspeed_runs("deepspeed_zero3.yaml")])
def test_gpu_dpo_with_its_reference_under_sharding(tmp_path, accelerate_config):
    """DPO under FSDP2 and ZeRO-3: the policy is sharded, the frozen reference is a full copy beside it; the run
    trains, logs rewards, and saves a full model gathered from the shards."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "dpo"
    args = ["--model_config", json.dumps(TINY_TEST_MODEL), "--output_dir", str(out),
            *"""--disable_tqdm true --synthetic_train_size 64 --synthetic_eval_size 8 --max_steps 4 --logging_steps 1
            --per_device_train_batch_size 4 --eval_on_start false --sft_warmup_steps 0 --save_steps 2
            --learning_rate 1e-3 --report_to none""".split()]  # fmt: skip
    result = launch("recipes/dpo.py", args, accelerate_config, launcher_args=ONE_PROCESS)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rewards/chosen"] is not None for r in records if "loss" in r)
    assert json.loads((out / "summary.json").read_text())["train_steps"] == 4
    AutoModelForCausalLM.from_pretrained(out)
