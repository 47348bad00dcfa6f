"""2 processes x 2 accumulated micro-batches of 2 train a vision-language model (a tiny Qwen2-VL, the pictures decoded
in each process's loader worker) as 1 process with batches of 8 does, and evaluate it alike.

tests/equivalence/test_multiprocess.py proves it for text; the same reasoning holds: both runs see the same 8 rows per
optimizer step, and the loss is normalised by the loss tokens of the whole step across micro-batches and processes,
so losses and parameters agree to float32 round-off. The rows differ in image tokens (pictures of 4 sizes) and loss
tokens. The evaluation set (5 rows) does not divide into 2 processes x 2: the padding duplicates must be dropped.
"""

from __future__ import annotations

import json

import pytest
import torch
from support import launch

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
TOL = 1e-5
COMMON = """--config recipes/configs/sft/vlm_default.yaml --disable_tqdm true --report_to none --synthetic_train_size 40
--synthetic_eval_size 5 --max_steps 3 --logging_steps 1 --warmup_ratio 0 --eval_on_start false --generation_eval false
--per_device_eval_batch_size 2 --dataloader_num_workers 1""".split()


def _run(out, accelerate_config, batch, k):
    args = [*COMMON, "--output_dir", str(out), "--per_device_train_batch_size", str(batch),
            "--gradient_accumulation_steps", str(k)]  # fmt: skip
    result = launch("recipes/sft.py", args, accelerate_config=accelerate_config)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, [r["loss"] for r in records if "loss" in r]


def test_two_processes_with_accumulation_equal_one_process(tmp_path):
    from safetensors.torch import load_file

    one, one_losses = _run(tmp_path / "one", "cpu.yaml", batch=8, k=1)
    two, two_losses = _run(tmp_path / "two", "multi_cpu.yaml", batch=2, k=2)
    assert one["num_processes"] == 1 and two["num_processes"] == 2 and len(one_losses) == 3
    assert one["train_tokens"] == two["train_tokens"] and one["data"]["images"] == two["data"]["images"]
    assert two_losses == pytest.approx(one_losses, rel=TOL)
    assert two["eval"]["eval_tokens"] == one["eval"]["eval_tokens"]
    assert two["eval"]["eval_loss"] == pytest.approx(one["eval"]["eval_loss"], rel=TOL)
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=TOL, rtol=TOL, msg=f"parameter {name}")
