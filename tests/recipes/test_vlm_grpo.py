"""recipes/grpo.py with a vision-language model: a tiny Qwen2-VL from recipes/configs/grpo/vlm_default.yaml, shrunk,
trains a few steps on prompts with pictures (the SFT warm-up, generation, the old policy's and the reference's
log-probs, all with the pictures), its rewards get each completion's own picture, and the output folder loads."""

from __future__ import annotations

import json

import pytest
from support import ROOT, launch
from transformers import AutoModelForImageTextToText

from tunebook.models.vision import load_processor

from recipe_runs import _records  # isort: skip

REWARDS = ROOT / "tests" / "recipes" / "grpo_rewards.py"


@pytest.mark.slow  # ~45 s on 2 cores (110 s when they are shared)
def test_grpo_trains_a_tiny_vlm_on_prompts_with_pictures(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEBOOK_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    args = ["--config", "recipes/configs/grpo/vlm_default.yaml", "--output_dir", str(out), "--report_to", "none",
            "--disable_tqdm", "true", "--synthetic_train_size", "48", "--synthetic_eval_size", "8",
            "--sft_warmup_steps", "3", "--max_steps", "3", "--per_device_train_batch_size", "4",
            "--num_generations", "4", "--num_iterations", "2", "--beta", "0.1", "--eval_steps", "0",
            "--logging_steps", "1", "--dataloader_num_workers", "1",
            # text_length: completions of one prompt earn different rewards, so the updates are not zero
            "--reward_functions", f"[exact_match, {REWARDS}:picture_shows_the_answer, {REWARDS}:text_length]"]  # fmt: skip
    result = launch("recipes/grpo.py", args)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "Model: Qwen2VLForConditionalGeneration" in result.stdout and "SFT warm-up step 3/3" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert (
        summary["train_steps"] == 3 and summary["data"]["images"] == 48 and summary["data"]["skipped_bad_image"] == 0
    )
    records = [r for r in _records(out) if "loss" in r]
    assert len(records) == 3 and all(r["grad_norm"] > 0 for r in records)
    # Every completion scored with its own prompt's picture, in training and in the evaluation
    generated = [r for r in records if r["completions/mean_length"] > 0]  # num_iterations 2: steps 1 and 3 sample
    assert len(generated) == 2 and all(r["rewards/picture_shows_the_answer/mean"] == 1.0 for r in generated)
    assert summary["eval"]["eval_rewards/picture_shows_the_answer"] == 1.0
    assert {"eval_exact_match", "eval_reward"} <= set(summary["eval"]) and records[-1]["kl"] >= 0
    model, processor = AutoModelForImageTextToText.from_pretrained(out), load_processor(str(out))
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration" and processor.chat_template
