"""LoRA (`use_peft`) in each recipe, unchanged otherwise: adapter-only checkpoints, the adapter directory as output,
a merged model with the same logits, and `tunebook export --merge` from a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from support import TINY_TEST_MODEL, launch

pytestmark = pytest.mark.slow
pytest.importorskip("peft")
LORA = ["--use_peft", "true", "--disable_tqdm", "true"]
TINY = ["--model_config", json.dumps(TINY_TEST_MODEL)]


def _ok(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_sft_lora_outputs_adapters_merges_exactly_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunebook.models import load_adapter_model

    # LoRA adapts a pretrained model: here a tiny one, briefly fully fine-tuned (a frozen random base barely moves).
    base = tmp_path / "base"
    common = ["--synthetic_train_size", "1000", "--generation_eval", "false", "--max_steps", "30"]
    _ok(launch("recipes/sft.py", [*common, "--disable_tqdm", "true", "--output_dir", str(base)]))  # the default model
    out = tmp_path / "sft"
    args = [*common, *LORA, "--model_name_or_path", str(base), "--merge_adapter", "true", "--logging_steps", "10",
            "--save_steps", "15", "--gradient_checkpointing", "true", "--packing", "true", "--max_seq_length", "64",
            "--output_dir", str(out)]  # fmt: skip
    result = _ok(launch("recipes/sft.py", args))
    assert "trainable (" in result.stdout
    losses = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert losses[-1] < 0.97 * losses[0], losses
    assert (
        json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "../base"
    )  # movable with it
    assert not (out / "base_model").exists()  # the base loads from where it came from
    summary = json.loads((out / "summary.json").read_text())
    assert 0 < summary["trainable_parameters"] < 0.5 * summary["total_parameters"]
    for checkpoint in (out / "checkpoints").iterdir():  # adapters and trainer state, no base weights
        assert (checkpoint / "adapter/adapter_model.safetensors").is_file()
        assert not list(checkpoint.glob("model*.safetensors"))

    tokenizer = AutoTokenizer.from_pretrained(out)
    inputs = tokenizer(["Reverse the digits.\n1234", "Sort the digits.\n981"], padding=True, return_tensors="pt")
    with torch.no_grad():
        adapter_logits = load_adapter_model(out).eval()(**inputs).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(out / "merged").eval()(**inputs).logits
        torch.testing.assert_close(merged_logits, adapter_logits, rtol=0, atol=1e-5)

        from tunebook.cli import main as cli

        cli(["export", str(out / "checkpoints/step-30"), str(tmp_path / "exported"), "--merge"])
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()(**inputs).logits
        torch.testing.assert_close(exported, merged_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("recipe", ["classify", "pretrain"])
def test_classify_and_pretrain_train_adapters(tmp_path, recipe):
    from tunebook.models import load_adapter_model

    out = tmp_path / recipe
    args = [*LORA, "--max_steps", "4", "--synthetic_train_size", "120", "--synthetic_eval_size", "16",
            "--output_dir", str(out)]  # fmt: skip
    if recipe == "pretrain":
        args += [*TINY, "--max_seq_length", "64"]
    _ok(launch(f"recipes/{recipe}.py", args))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["task_type"] == ("SEQ_CLS" if recipe == "classify" else "CAUSAL_LM")
    model = load_adapter_model(out)
    if recipe == "classify":  # the new head is trained in full and saved with the adapters
        assert model.config.num_labels == len(json.loads((out / "summary.json").read_text())["labels"])
