"""recipes/dpo.py on preference pairs with images: a tiny Qwen2-VL trains a few steps on the shapes pairs
(recipes/configs/dpo/vlm_default.yaml, shrunk), its pairs' images decoded in a loader worker, against each kind of
reference (a frozen copy, LoRA's adapters off, precomputed), which sees the same images; the reward figures are logged and summarised, and the output loads as a VLM."""

from __future__ import annotations

import json
import math

import pytest
from support import launch
from transformers import AutoModelForImageTextToText

from tunebook.models.vision import load_processor


@pytest.mark.slow
@pytest.mark.parametrize(
    ("reference", "extra"),
    [("copy", []), ("adapters off", ["--use_peft", "true"]), ("precomputed", ["--precompute_ref_log_probs", "true"])],
)
def test_a_tiny_vlm_trains_on_image_pairs_and_logs_its_reward_accuracy(tmp_path, monkeypatch, reference, extra):
    monkeypatch.setenv("TUNEBOOK_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    args = ["--config", "recipes/configs/dpo/vlm_default.yaml", "--output_dir", str(out), "--report_to", "none",
            "--disable_tqdm", "true", "--synthetic_train_size", "48", "--synthetic_eval_size", "8",
            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--max_steps", "4",
            "--logging_steps", "2", "--sft_warmup_steps", "2", "--dataloader_num_workers", "1", *extra]  # fmt: skip
    result = launch("recipes/dpo.py", args)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    model_line = "Model: PeftModel" if extra[:1] == ["--use_peft"] else "Model: Qwen2VLForConditionalGeneration"
    assert model_line in result.stdout and "SFT warm-up step 2/2" in result.stdout
    assert "<|image_pad|>" in result.stdout.split("One training pair", 1)[1]  # the logged pair shows its image
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_steps"] == 4 and summary["reference"] == reference
    before, after = summary["eval_before_training"], summary["eval"]
    # Before training the policy is its reference, which saw the same images (a copy, the adapters off, or computed
    # once before training): every reward 0, the loss log 2.
    assert before["eval_loss"] == pytest.approx(math.log(2), abs=1e-6) and before["eval_rewards/margin"] == 0
    assert (
        after["eval_pairs"] == 8
        and 0 <= after["eval_rewards/accuracy"] <= 1
        and after["eval_loss"] != before["eval_loss"]
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "rewards/accuracy" in r and "eval_loss" not in r]
    assert [r["step"] for r in train] == [2, 4]
    assert {"loss", "rewards/chosen", "rewards/rejected", "rewards/margin"} <= set(train[-1])
    assert load_processor(str(out)).chat_template
    if reference == "adapters off":  # the output holds the adapters only
        assert (out / "adapter_config.json").is_file()
    else:
        assert type(AutoModelForImageTextToText.from_pretrained(out)).__name__ == "Qwen2VLForConditionalGeneration"
