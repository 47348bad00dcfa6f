"""recipes/sft.py on image-text data: the vision-language default (a tiny Qwen2-VL learns the generated shapes task
from chance to >= 0.9 exact match of its greedy answers on held-out pictures), and a tiny LLaVA trained a few steps,
whose output folder loads with AutoModelForImageTextToText and its processor and gives the logits it trained to."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from support import launch
from transformers import AutoConfig, AutoModelForImageTextToText

from tunebook.config.tiny import TINY_LLAVA
from tunebook.data.image_files import open_image
from tunebook.models.vision import load_processor


def _ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.mark.slow
def test_the_vlm_default_learns_the_shapes_task(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEBOOK_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    args = ["--config", "recipes/configs/sft/vlm_default.yaml", "--output_dir", str(out), "--report_to", "none",
            "--disable_tqdm", "true"]  # fmt: skip
    result = _ok(launch("recipes/sft.py", args))
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["eval_before_training"]["eval_exact_match"], summary["eval"]["eval_exact_match"]
    assert before < 0.3 and after >= 0.9, (before, after)
    assert "AutoModelForImageTextToText" in result.stdout  # the load line names the vision-language class
    model, processor = AutoModelForImageTextToText.from_pretrained(out), load_processor(str(out))
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration" and processor.chat_template


def test_a_tiny_llava_trains_saves_and_reloads_with_the_same_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEBOOK_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    args = ["--config", "recipes/configs/sft/vlm_default.yaml", "--model_config", json.dumps(TINY_LLAVA),
            "--output_dir", str(out), "--report_to", "none", "--disable_tqdm", "true", "--max_steps", "4",
            "--save_steps", "4", "--synthetic_train_size", "64", "--synthetic_eval_size", "8",
            "--per_device_train_batch_size", "8", "--max_pixels", "null", "--generation_max_new_tokens", "2",
            "--dataloader_num_workers", "1"]  # fmt: skip
    result = _ok(launch("recipes/sft.py", args))
    assert "Model: LlavaForConditionalGeneration" in result.stdout
    assert "Load it: from transformers import AutoModelForImageTextToText" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_steps"] == 4 and "eval_exact_match" in summary["eval"]

    model, processor = AutoModelForImageTextToText.from_pretrained(out).eval(), load_processor(str(out))
    data = next((tmp_path / "cache" / "synthetic").glob("shapes-*"))
    row = json.loads((data / "eval.jsonl").read_text().splitlines()[0])
    image = open_image({"path": str(data / row["images"][0]), "bytes": None})
    text = processor.apply_chat_template(row["messages"], tokenize=False)
    batch = processor(text=[text], images=[image], return_tensors="pt")
    assert (batch["input_ids"] == processor.image_token_id).sum() == 4  # the tower's 2 x 2 patches
    # The weights the run trained, as its step-4 checkpoint holds them (the training state, not save_pretrained's
    # output): the saved model scores the row exactly as they do.
    checkpoint = out / "checkpoints" / "step-4"
    trained = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(checkpoint / "model_config"))
    missing, unexpected = trained.load_state_dict(load_file(checkpoint / "model.safetensors"), strict=False)
    assert not unexpected and all("lm_head" in key for key in missing), (missing, unexpected)  # tied to embeddings
    trained.tie_weights()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, trained.eval()(**batch).logits)


@pytest.mark.slow
def test_the_vlm_default_trains_on_packed_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEBOOK_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    args = ["--config", "recipes/configs/sft/vlm_default.yaml", "--packing", "true", "--output_dir", str(out),
            "--report_to", "none", "--disable_tqdm", "true", "--max_steps", "6", "--synthetic_train_size", "200",
            "--synthetic_eval_size", "16", "--per_device_train_batch_size", "8", "--generation_max_new_tokens", "2",
            "--dataloader_num_workers", "1"]  # fmt: skip
    result = _ok(launch("recipes/sft.py", args))
    assert "train data: packed 200 examples into" in result.stdout
    assert "Packing with tunebook_segment_sdpa attention" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["packing_efficiency"] > 0.85 and summary["train_steps"] == 6
    assert summary["train_samples"] > 6 * 8  # rows of several examples each (1 a row would be 48)
    assert summary["eval"]["eval_loss"] < summary["eval_before_training"]["eval_loss"]
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_eval_only_loss_is_the_same_packed_and_padded(tmp_path, monkeypatch, family):
    """The recipe's evaluation of one model on one eval set, padded and packed: the same loss (float32, 1e-5)."""
    monkeypatch.setenv("TUNEBOOK_CACHE", str(tmp_path / "cache"))
    model = [] if family == "qwen2_vl" else ["--model_config", json.dumps(TINY_LLAVA), "--max_pixels", "null"]
    summaries = {}
    for packing in ("false", "true"):
        out = tmp_path / f"packing-{packing}"
        args = ["--config", "recipes/configs/sft/vlm_default.yaml", *model, "--packing", packing, "--output_dir",
                str(out), "--report_to", "none", "--disable_tqdm", "true", "--max_steps", "0",
                "--synthetic_train_size", "32", "--synthetic_eval_size", "40", "--generation_eval", "false",
                "--dataloader_num_workers", "1"]  # fmt: skip
        _ok(launch("recipes/sft.py", args))
        summaries[packing] = json.loads((out / "summary.json").read_text())
    padded, packed = summaries["false"]["eval"], summaries["true"]["eval"]
    assert packed["eval_tokens"] == padded["eval_tokens"] > 0
    assert packed["eval_loss"] == pytest.approx(padded["eval_loss"], rel=1e-5)
    assert summaries["true"]["data"]["packing_efficiency"] > 0.5
