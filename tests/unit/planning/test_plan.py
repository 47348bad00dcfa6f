"""The plan's states per engine against the parameter counts, LoRA against peft's own count, the
recommendations against a plan that fits, the accelerate configs read as the engines they are."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import ROOT

from tunebook.config import parse_config
from tunebook.errors import ConfigError
from tunebook.planning import GPUS, Layout, hardware, parse_memory, plan, read_layout
from tunebook.planning.at_start import _choose_batch
from tunebook.planning.recommend import recommend, smaller_micro_batches
from tunebook.recipe import recipe_config_class

SMALL = {"packing": "true", "max_seq_length": "128", "per_device_train_batch_size": "8"}


def _config(recipe="sft", **overrides):
    values = {**(SMALL if recipe == "sft" else {}), **{k: str(v) for k, v in overrides.items()}}
    return parse_config(recipe_config_class(recipe), overrides=values)


def test_states_follow_the_engine_sharding():
    config = _config()
    device = hardware("H100-80GB", num_gpus=4)
    single = plan("sft", config, Layout(), device)
    params = single.params
    assert single.weights == params * 4  # float32 weights (dtype auto, full fine-tuning)
    assert single.gradients == params * 4 and single.optimizer == params * 8  # AdamW: two float32 moments
    ddp = plan("sft", config, Layout("ddp", 4, "bf16"), device)
    assert ddp.gradients == 2 * single.gradients  # and DDP's bucket copy of them
    assert ddp.optimizer == single.optimizer and ddp.weights == single.weights
    fsdp = plan("sft", config, Layout("fsdp2", 4, "bf16", 4), device)
    assert fsdp.optimizer == pytest.approx(single.optimizer / 4)
    assert fsdp.gradients == pytest.approx(single.gradients / 4)
    assert single.weights / 4 < fsdp.weights < single.weights / 4 + params * 2  # + the gathered bf16 layers
    zero3 = plan("sft", config, Layout("zero3", 4, "bf16", 4), device)
    assert zero3.optimizer == pytest.approx(12 * params / 4)  # float32 master weights and moments, sharded
    zero2 = plan("sft", config, Layout("zero2", 4, "bf16", 4), device)
    assert zero2.weights == params * 2 and zero2.optimizer == zero3.optimizer
    assert single.total > single.allocated > 0 and single.fits


def test_lora_trains_what_peft_trains():
    from tunebook.models import apply_lora, build_causal_lm
    from tunebook.models.build import model_options
    from tunebook.models.tokenizer import train_chat_tokenizer

    config = _config(use_peft=True)
    tokenizer = train_chat_tokenizer(["hello there general kenobi"] * 20, vocab_size=config.tokenizer_vocab_size)
    config.model_config = {**config.model_config, "vocab_size": len(tokenizer)}
    model = apply_lora(build_causal_lm(tokenizer, model_options(config)), config)
    planned = plan("sft", config, Layout(), hardware("H100"))
    assert planned.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert planned.params == sum(p.numel() for p in model.parameters())
    full = plan("sft", _config(), Layout(), hardware("H100"))
    assert planned.optimizer < full.optimizer / 4  # the adapters' moments only


def test_a_reference_model_and_generation_are_planned_where_the_recipe_has_them():
    dpo = plan("dpo", _config("dpo"), Layout(), hardware("H100"))
    assert dpo.reference == dpo.weights  # a frozen float32 copy of the policy
    assert plan("dpo", _config("dpo", precompute_ref_log_probs=True), Layout(), hardware("H100")).reference == 0
    assert plan("dpo", _config("dpo", use_peft=True), Layout(), hardware("H100")).reference == 0  # adapters off
    grpo = plan("grpo", _config("grpo"), Layout(), hardware("H100"))
    assert grpo.generation > 0 and grpo.reference == 0  # beta 0: no reference
    colocated = plan(
        "grpo", _config("grpo", use_vllm=True, vllm_gpu_memory_utilization=0.3), Layout(), hardware("H100")
    )
    assert colocated.generation == pytest.approx(0.3 * GPUS["H100-80GB"])
    server = plan("grpo", _config("grpo", use_vllm=True, vllm_mode="server"), Layout(), hardware("H100"))
    assert server.generation == 0


def test_a_distillation_teacher_is_planned_at_its_own_size_and_dtype(tmp_path: Path):
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    teacher = {"model_type": "llama", "hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 3,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}  # fmt: skip
    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.for_model(**teacher)).parameters())
    config = _config("distill", teacher_model_config=json.dumps(teacher), tokenizer_vocab_size=512)
    on_cpu = plan("distill", config, Layout(), hardware("H100"), on_gpu=False)
    assert on_cpu.reference == count * 4 and on_cpu.reference != on_cpu.weights  # float32 beside a float32 student
    on_gpu = plan("distill", config, Layout(), hardware("H100"))
    assert on_gpu.reference == count * 2  # teacher_dtype auto: bf16 on a GPU
    assert plan("distill", config, Layout("zero3", 4, "bf16", 4), hardware("H100")).reference == count * 2 / 4
    # The teacher's forward costs its own FLOPs: a larger teacher, a slower step.
    larger = _config("distill", teacher_model_config=json.dumps({**teacher, "num_hidden_layers": 12}),
                     tokenizer_vocab_size=512)  # fmt: skip
    assert plan("distill", larger, Layout(), hardware("H100")).tokens_per_second < on_gpu.tokens_per_second
    # --teacher_architecture: a config.json; none readable (a Hub name offline): the student's size, said.
    (tmp_path / "config.json").write_text(json.dumps({**teacher, "num_hidden_layers": 6}))
    from_file = plan("distill", config, Layout(), hardware("H100"), on_gpu=False, teacher_architecture=tmp_path)
    assert from_file.reference > on_cpu.reference
    unread = _config("distill", teacher_model_name_or_path=str(tmp_path / "missing"), tokenizer_vocab_size=512)
    fallback = plan("distill", unread, Layout(), hardware("H100"), on_gpu=False)
    assert fallback.reference == fallback.weights and "the teacher counted at the student's size" in fallback.notes[0]


def test_checkpointing_and_smaller_micro_batches_lower_the_activations():
    base = plan("sft", _config(), Layout(), hardware("H100"))
    checkpointed = plan("sft", _config(gradient_checkpointing=True), Layout(), hardware("H100"))
    half = plan("sft", _config(per_device_train_batch_size=4), Layout(), hardware("H100"))
    assert checkpointed.activations < 0.6 * base.activations
    assert half.activations == pytest.approx(base.activations / 2, rel=0.1)  # and a few fixed buffers
    assert checkpointed.tokens_per_second == pytest.approx(base.tokens_per_second * 6 / 8)  # the recompute


def test_the_recommendation_fits_and_keeps_the_samples_per_step():
    config = _config(gradient_accumulation_steps=2)
    base = plan("sft", config, Layout(), hardware("H100"), on_gpu=False)
    device = hardware(gpu_memory=f"{base.total * 0.6 / 2**30:.4f}GiB")

    def planner(changed, layout):
        return plan("sft", changed, layout, device, on_gpu=False)

    assert not planner(config, Layout()).fits
    overrides, fitted = recommend(config, Layout(), 1, planner)
    batch = int(overrides[0].removeprefix("--per_device_train_batch_size "))
    assert fitted.fits and overrides == [
        f"--per_device_train_batch_size {batch}",
        f"--gradient_accumulation_steps {16 // batch}",
    ]  # 8 x 2 samples per step
    larger = [(b, k) for b, k in smaller_micro_batches(8, 2) if b > batch]  # the largest that fits: the next not
    bigger, steps = larger[-1]
    assert not planner(_config(per_device_train_batch_size=bigger, gradient_accumulation_steps=steps), Layout()).fits
    tiny = hardware(gpu_memory="1MiB")
    assert recommend(config, Layout(), 1, lambda c, layout: plan("sft", c, layout, tiny)) == ([], None)


def test_smaller_micro_batches_keep_the_product():
    assert smaller_micro_batches(8, 1) == [(4, 2), (2, 4), (1, 8)]
    assert smaller_micro_batches(6, 2) == [(4, 3), (3, 4), (2, 6), (1, 12)] or all(
        b * k == 12 and k % 2 == 0 for b, k in smaller_micro_batches(6, 2)
    )


def test_auto_picks_the_largest_micro_batch_that_fits(caplog):
    import logging

    config = _config(per_device_train_batch_size="auto")
    assert config.per_device_train_batch_size == "auto"
    default = 32  # SFTConfig's
    full = plan("sft", _config(per_device_train_batch_size=default), Layout(), hardware("H100"), on_gpu=False)
    device = hardware(gpu_memory=f"{full.total * 0.4 / 2**30:.4f}GiB")
    device = type(device)("CPU", device.memory, 1, None)
    batch, steps = _choose_batch(config, "sft", Layout(), device, logging.getLogger("test"))
    assert batch * steps == default and batch < default
    fitted = plan("sft", _config(per_device_train_batch_size=batch, gradient_accumulation_steps=steps), Layout(),
                  device, on_gpu=False)  # fmt: skip
    assert fitted.fits
    with pytest.raises(ConfigError, match="not even 1 fits"):
        _choose_batch(config, "sft", Layout(), type(device)("CPU", 1024, 1, None), logging.getLogger("test"))


@pytest.mark.parametrize(
    ("name", "engine", "shards"),
    [("cpu.yaml", "single", 1), ("single_gpu.yaml", "single", 1), ("multi_gpu.yaml", "ddp", 1),
     ("fsdp.yaml", "fsdp2", 8), ("deepspeed_zero2.yaml", "zero2", 8), ("deepspeed_zero3.yaml", "zero3", 8)],
)  # fmt: skip
def test_the_shipped_accelerate_configs_read_as_their_engines(name, engine, shards):
    layout = read_layout(ROOT / "accelerate_configs" / name)
    assert (layout.engine, layout.shard_over) == (engine, shards)
    if engine == "fsdp2":
        assert layout.activation_checkpointing and layout.mixed_precision == "bf16"
        assert read_layout(ROOT / "accelerate_configs" / name, num_gpus=4).shard_over == 4  # --num_gpus wins


def test_bad_accelerate_configs_and_sizes_stop_with_one_line(tmp_path: Path):
    (tmp_path / "bad.yaml").write_text("distributed_type: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: not YAML"):
        read_layout(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="missing.yaml"):
        read_layout(tmp_path / "missing.yaml")
    (tmp_path / "fsdp1.yaml").write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n")
    with pytest.raises(ConfigError, match="FSDP2"):
        read_layout(tmp_path / "fsdp1.yaml")
    assert parse_memory("24GiB") == parse_memory("24 GB") == 24 * 2**30
    assert parse_memory("16000MiB") == 16000 * 2**20
    with pytest.raises(ConfigError, match="--gpu_memory 'lots'"):
        parse_memory("lots")
    with pytest.raises(ConfigError, match="ambiguous"):
        hardware("A100")  # 40 or 80 GB
    assert hardware("L4").name == "L4-24GB" and hardware("h100").peak_flops == 989e12
