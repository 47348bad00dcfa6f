"""LoRA through peft: only adapters train, checkpoints hold only adapters, merging changes no logit."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from tunebook.config import SFTConfig, parse_config
from tunebook.errors import ConfigError
from tunebook.models import apply_lora, build_causal_lm, register_adapter_checkpoints
from tunebook.models.build import quantization
from tunebook.training import build_optimizer
from tunebook.training.checkpoint import save_adapter

peft = pytest.importorskip("peft")


def _batch(tokenizer):
    texts = ["Reverse the digits.\n1234 4321", "Sort the digits.\n3141 1134", "hello world, two plus two"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return dict(batch)


def test_lora_trains_only_adapters_and_the_merged_model_has_the_same_logits(
    tmp_path, tiny_tokenizer, tiny_model_config
):
    accelerator = Accelerator(cpu=True)
    register_adapter_checkpoints(accelerator, tmp_path / "run")
    torch.manual_seed(0)
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config)
    base = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    config = SFTConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)
    model = apply_lora(model, config)
    optimizer = build_optimizer(model, 3e-2, 0.0, (0.9, 0.999), 1e-8)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = _batch(tiny_tokenizer)
    losses = []
    for _ in range(15):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.2  # a frozen random base (small logits) limits how fast; it still learns

    # Every base weight bit for bit as built; the adapters moved.
    trained = model.get_base_model().state_dict()
    frozen = {name.replace(".base_layer", ""): t for name, t in trained.items() if "lora_" not in name}
    assert frozen.keys() == base.keys()
    assert all(torch.equal(frozen[name], base[name]) for name in base)
    assert any(name.endswith("lora_B.default.weight") and t.abs().sum() > 0 for name, t in trained.items())

    # A checkpoint holds the adapters (and optimizer), not the base weights; loading it restores them exactly.
    accelerator.save_state(tmp_path / "checkpoint", safe_serialization=True)
    assert (tmp_path / "checkpoint/adapter/adapter_model.safetensors").is_file()
    assert not list((tmp_path / "checkpoint").glob("model*.safetensors"))
    model.eval()
    with torch.no_grad():
        logits = model(**batch).logits
    lora_b = next(p for n, p in model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        lora_b.add_(1.0)
    accelerator.load_state(tmp_path / "checkpoint")
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, logits)

    # The output: an adapter directory (load_adapter_model finds the saved base), and the merged plain model.
    save_adapter(accelerator, model, tiny_tokenizer, tmp_path / "out", merge=True)
    from transformers import AutoModelForCausalLM

    from tunebook.models import load_adapter_model

    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        adapter_logits = load_adapter_model(tmp_path / "out").eval()(**inputs).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(tmp_path / "out/merged").eval()(**inputs).logits
    torch.testing.assert_close(adapter_logits, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(merged_logits, adapter_logits, rtol=0, atol=1e-5)


def test_lora_settings_are_checked():
    with pytest.raises(ConfigError, match="merge_adapter: true needs use_peft: true"):
        parse_config(SFTConfig, overrides={"merge_adapter": True})
    with pytest.raises(ConfigError, match="load_in_4bit quantises pretrained weights"):
        parse_config(SFTConfig, overrides={"use_peft": True, "load_in_4bit": True})
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="load_in_4bit \\(QLoRA\\) needs a CUDA GPU"):
            quantization(True)
    with pytest.raises(ConfigError, match="lora_target_modules"):
        apply_lora(torch.nn.Sequential(torch.nn.Linear(2, 2)), SFTConfig(use_peft=True, lora_target_modules="nope"))


def test_an_adapter_names_its_local_base_relative_to_itself_and_moves_with_it(
    tmp_path, tiny_tokenizer, tiny_model_config
):
    import json
    import shutil

    from tunebook.models import load_adapter_model, load_tokenizer, merge_adapter_dir

    torch.manual_seed(0)
    build_causal_lm(tiny_tokenizer, model_config=tiny_model_config).save_pretrained(tmp_path / "work/base")
    tiny_tokenizer.save_pretrained(tmp_path / "work/base")
    tokenizer = load_tokenizer(str(tmp_path / "work/base"))  # from a folder: transformers records is_local
    assert tokenizer.init_kwargs.get("is_local") is True
    model = apply_lora(build_causal_lm(tokenizer, model_name_or_path=str(tmp_path / "work/base")),
                       SFTConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0))  # fmt: skip
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).add_(0.5)  # adapters that change the logits
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(model)
    save_adapter(accelerator, model, tokenizer, tmp_path / "work/runs/out")
    inputs = {k: v for k, v in _batch(tokenizer).items() if k != "labels"}
    with torch.no_grad():
        logits = model.eval()(**inputs).logits

    out = tmp_path / "work/runs/out"
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "../../base"
    saved = json.loads((out / "tokenizer_config.json").read_text())
    assert "is_local" not in saved and "local_files_only" not in saved
    shutil.move(tmp_path / "work", tmp_path / "moved")  # the run and its base, moved together
    moved = tmp_path / "moved/runs/out"
    with torch.no_grad():
        torch.testing.assert_close(load_adapter_model(moved).eval()(**inputs).logits, logits, rtol=0, atol=1e-5)
        from transformers import AutoModelForCausalLM

        merged = AutoModelForCausalLM.from_pretrained(merge_adapter_dir(moved, tmp_path / "merged")).eval()
        torch.testing.assert_close(merged(**inputs).logits, logits, rtol=0, atol=1e-5)


def test_without_peft_lora_is_one_line_naming_the_extra(monkeypatch, tmp_path, tiny_tokenizer, tiny_model_config):
    import sys

    from tunebook.models import load_adapter_model

    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config)
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` fails as it does where it is not installed
    with pytest.raises(ConfigError, match=r"^use_peft needs peft: pip install 'tunebook\[peft\]'$"):
        apply_lora(model, SFTConfig(use_peft=True))
    (tmp_path / "adapter_config.json").write_text('{"base_model_name_or_path": "./base"}')
    with pytest.raises(ConfigError, match=r"^LoRA adapters need peft: pip install 'tunebook\[peft\]'$"):
        load_adapter_model(tmp_path)
