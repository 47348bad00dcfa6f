"""2 processes x 2 accumulated micro-batches of 2 train the same model as 1 process with batches of 8.

Run with length-grouped batches and with packed rows (the synthetic examples are ~30 tokens, so rows of 96 hold
about three).

Both runs see the same 8 examples per optimizer step (Accelerate's seedable sampler shuffles globally and
hands consecutive batches to consecutive ranks), so with the loss normalised by the loss tokens of the whole
step across micro-batches and processes the parameters must agree to float32 round-off. A per-micro-batch or
per-process mean would not: the examples have different numbers of loss tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
from support import TINY_TEST_MODEL, launch

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
TOL = 1e-5
COMMON = [
    "--model_config", json.dumps(TINY_TEST_MODEL),
    *"""--disable_tqdm true --synthetic_train_size 200 --synthetic_eval_size 13 --max_steps 4 --logging_steps 1
    --learning_rate 1e-3 --warmup_ratio 0 --eval_on_start false --generation_eval false
    --per_device_eval_batch_size 4""".split(),
]  # fmt: skip


def _run(out, accelerate_config, batch, k, extra):
    args = [*COMMON, *extra, "--output_dir", str(out), "--per_device_train_batch_size", str(batch),
            "--gradient_accumulation_steps", str(k)]  # fmt: skip
    result = launch("recipes/sft.py", args, accelerate_config=accelerate_config)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    losses = [
        json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line
    ]
    return summary, losses


@pytest.mark.parametrize(
    "extra",
    [["--group_by_length", "true"], ["--packing", "true", "--max_seq_length", "96"]],
    ids=["length-grouped", "packed"],
)
def test_two_processes_with_accumulation_equal_one_process(tmp_path, extra):
    from safetensors.torch import load_file

    one, one_losses = _run(tmp_path / "one", "cpu.yaml", batch=8, k=1, extra=extra)
    two, two_losses = _run(tmp_path / "two", "multi_cpu.yaml", batch=2, k=2, extra=extra)
    assert one["num_processes"] == 1 and two["num_processes"] == 2 and len(one_losses) == 4
    assert one["train_tokens"] == two["train_tokens"]
    assert two_losses == pytest.approx(one_losses, rel=TOL)
    # The eval set does not divide into 2 processes x 4: gather_for_metrics must drop the padding duplicates.
    assert two["eval"]["eval_tokens"] == one["eval"]["eval_tokens"]
    assert two["eval"]["eval_loss"] == pytest.approx(one["eval"]["eval_loss"], rel=TOL)
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=TOL, rtol=TOL, msg=f"parameter {name}")
