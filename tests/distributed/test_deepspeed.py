"""DeepSpeed ZeRO-2 and ZeRO-3, through accelerate_configs/deepspeed_zero2.yaml and deepspeed_zero3.yaml, on the CPU
(DeepSpeed's CPU accelerator, gloo, mixed precision off): the same training as without DeepSpeed, and a run resumed
from a checkpoint continues it exactly.

From the same saved model, each DeepSpeed run logs the losses of the plain run (DDP over as many processes, or one
process) to 1e-5 and moves every parameter as it does (to 1e-3 of the update's norm: `_assert_same_updates`); the run
resumed from its step-3 checkpoint logs the same losses and ends with the same weights, bit for bit. Each of these
failed before the fixes they came with: a resumed run restarted its learning-rate schedule (Accelerate left the
scheduler out of DeepSpeed checkpoints), ZeRO-3 models started from uninitialised embeddings and DPO's warm-up and
reference ran on partitioned (empty) weights, and an epoch's last window stepped the engine after every micro-batch.
Under ZeRO-3, DPO's and GRPO's frozen reference is partitioned over the processes too (GRPO is only resumed: its
sampled completions differ from DDP's by ~5e-5 in loss).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support import ROOT, TINY_TEST_MODEL, launch

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
COMMON = """--disable_tqdm true --max_steps 6 --logging_steps 1 --per_device_train_batch_size 4
    --gradient_accumulation_steps 2 --eval_on_start false --learning_rate 1e-3 --report_to none
    --synthetic_train_size 64 --synthetic_eval_size 8 --save_steps 3 --save_total_limit 0""".split()
TASKS = {
    "sft": ["--generation_eval", "false"],
    "dpo": ["--sft_warmup_steps", "2"],
    # With a KL term, so a frozen reference is built; a reward that random completions sometimes earn.
    "grpo": ["--sft_warmup_steps", "0", "--beta", "0.1", "--num_generations", "2", "--max_new_tokens", "4",
             "--reward_functions", json.dumps([str(ROOT / "tests" / "recipes" / "grpo_rewards.py") + ":text_length"])],
}  # fmt: skip


@pytest.fixture(scope="module")
def start(tmp_path_factory, tiny_tokenizer):
    """A saved tiny model (and tokenizer): every run starts from these weights, whatever the engine builds."""
    from tunebook.models import build_causal_lm

    path = tmp_path_factory.mktemp("start")
    build_causal_lm(tiny_tokenizer, model_config=TINY_TEST_MODEL).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, start):
    """The plain (DDP) run of a recipe on as many processes, launched once for every engine compared with it."""
    runs = {}

    def run(recipe, processes):
        if (recipe, processes) not in runs:
            out = tmp_path_factory.mktemp(f"plain-{recipe}-{processes}")
            _train(recipe, "multi_cpu.yaml" if processes > 1 else "cpu.yaml", processes, start, out)
            runs[recipe, processes] = out
        return runs[recipe, processes]

    return run


def _launch(recipe, config, processes, start, out, *extra, launcher_extra=()):
    args = [*COMMON, *TASKS[recipe], "--model_name_or_path", str(start), "--output_dir", str(out), *extra]
    launcher = ("--num_processes", str(processes), "--mixed_precision", "no", *launcher_extra)
    return launch(f"recipes/{recipe}.py", args, config, launcher_args=launcher)


def _train(recipe, config, processes, start, out, *extra):
    result = _launch(recipe, config, processes, start, out, *extra)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def _resume_matches(recipe, config, processes, start, full, resumed) -> None:
    """`full`'s run resumed from its step-3 checkpoint logs the same losses and ends with the same weights, bit for
    bit."""
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-6")
    _train(recipe, config, processes, start, resumed, "--resume_from_checkpoint", "latest")
    assert sorted(_losses(full)) == list(range(1, 7)) and _losses(resumed) == _losses(full)
    assert (resumed / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()


def _losses(out) -> dict[int, float]:
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _assert_same_updates(start, plain, other) -> None:
    """Every parameter of run `other` moved from `start` as in run `plain`: the two updates agree to 1e-3 of the update's
    norm.

    Not element by element: DeepSpeed sums gradients in another order than DDP (~1e-7 apart), and Adam divides each
    element by its own running size. An element whose gradient cancels down to that rounding (DPO's chosen and
    rejected terms, early on) then steps by a share of the learning rate either way. In 2 of 10 random start models one
    DPO weight in thousands ended ~2e-5 apart under ZeRO-3 (5 steps at lr 1e-3), where the update norms agreed to
    9e-5; a real fault (a lost gradient share, a restarted schedule) moves whole updates."""
    first, a, b = _weights(start), _weights(plain), _weights(other)
    assert a.keys() == b.keys() == first.keys()
    for name in a:
        expected, got = a[name] - first[name], b[name] - first[name]
        gap, size = float((got - expected).norm()), float(expected.norm())
        assert gap <= 1e-3 * size + 1e-8, f"parameter {name}: update {size:.3e}, off by {gap:.3e}"


def _weights(out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")


@pytest.mark.parametrize(
    ("config", "recipe", "processes"),
    [("deepspeed_zero2.yaml", "sft", 2), ("deepspeed_zero3.yaml", "sft", 2), ("deepspeed_zero3.yaml", "dpo", 2)],
)
def test_deepspeed_trains_as_plain_training_and_resumes_exactly(tmp_path, start, plain_run, config, recipe, processes):
    plain, full, resumed = plain_run(recipe, processes), tmp_path / "deepspeed", tmp_path / "resumed"
    result = _train(recipe, config, processes, start, full)
    stage = config.removeprefix("deepspeed_zero").removesuffix(".yaml")
    assert f"Launch: DeepSpeed ZeRO-{stage}, {processes} processes on cpu" in result.stdout + result.stderr
    if recipe == "dpo":  # the frozen reference is sharded as the policy is, not whole on every process
        assert f"Reference model: ZeRO-3 partitioned over {processes} process(es)" in result.stdout + result.stderr
    assert (full / "checkpoints" / "step-3" / "pytorch_model").is_dir()  # DeepSpeed's own checkpoint files
    # The schedule Accelerate leaves out is saved as JSON, not as a custom object it would unpickle on resume.
    assert (full / "checkpoints" / "step-3" / "lr_scheduler.json").is_file()
    assert not list((full / "checkpoints" / "step-3").glob("custom_checkpoint_*"))

    reference = _losses(plain)
    assert sorted(_losses(full)) == list(range(1, 7))
    assert [_losses(full)[s] for s in range(1, 7)] == pytest.approx([reference[s] for s in range(1, 7)], rel=1e-5)
    _assert_same_updates(start, plain, full)  # the final model gathered from the shards

    _resume_matches(recipe, config, processes, start, full, resumed)

    if config == "deepspeed_zero2.yaml":  # once: checkpoints of earlier Tunebooks (no manifest)
        old = tmp_path / "old"
        shutil.copytree(full, old)
        shutil.rmtree(old / "checkpoints" / "step-6")
        step_3 = old / "checkpoints" / "step-3"
        (step_3 / "manifest.json").unlink()
        schedule = json.loads((step_3 / "lr_scheduler.json").read_text())
        (step_3 / "lr_scheduler.json").unlink()  # without the schedule (as written before it was saved)
        result = _launch(recipe, config, processes, start, old, "--resume_from_checkpoint", "latest")
        assert result.returncode != 0
        assert "holds no learning-rate schedule" in result.stdout + result.stderr
        torch.save(schedule, step_3 / "custom_checkpoint_0.pkl")  # pickled (as written before lr_scheduler.json)
        result = _launch(recipe, config, processes, start, old, "--resume_from_checkpoint", "latest")
        assert result.returncode != 0
        assert "holds its learning-rate schedule as a pickle" in result.stdout + result.stderr


def test_grpo_under_zero3_partitions_its_reference_and_resumes_exactly(tmp_path, start):
    """GRPO's frozen reference (for the KL term) is partitioned over the processes as the policy is, and a run
    resumed from its step-3 checkpoint logs the same losses and ends with the same weights, bit for bit. (Against
    DDP its sampled completions make losses differ by ~5e-5, so it is not compared with plain training here.)"""
    full, resumed = tmp_path / "deepspeed", tmp_path / "resumed"
    result = _train("grpo", "deepspeed_zero3.yaml", 2, start, full)
    assert "Reference model: ZeRO-3 partitioned over 2 process(es)" in result.stdout + result.stderr
    _resume_matches("grpo", "deepspeed_zero3.yaml", 2, start, full, resumed)


def test_zero3_without_gathered_16bit_weights_stops_at_start_up(tmp_path, start):
    """Else Accelerate refuses to gather the final model only after the whole run has trained."""
    out = tmp_path / "out"
    result = _launch(
        "sft", "deepspeed_zero3.yaml", 1, start, out, launcher_extra=("--zero3_save_16bit_model", "false")
    )
    assert result.returncode != 0
    assert "ZeRO-3 without zero3_save_16bit_model: true" in result.stdout + result.stderr
    assert not (out / "metrics.jsonl").exists()


def test_a_zero3_partitioned_policy_reaches_the_inference_engine_whole_on_every_process(tmp_path):
    """GRPO's weight sync under ZeRO-3: the partitioned (empty) parameters are gathered once, whole on every process,
    plain names, LoRA merged, as the unpartitioned model gives them."""
    from engine_weights_sharded import same_as_unsharded

    result = launch("tests/distributed/engine_weights_sharded.py", ["zero3", str(tmp_path)], "deepspeed_zero3.yaml",
                    launcher_args=("--num_processes", "2", "--mixed_precision", "no"), launcher="accelerate")  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    same_as_unsharded(tmp_path / "zero3", names=("lora",))
