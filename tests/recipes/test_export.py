"""`tunebook export` for every recipe, full weights and LoRA: the exported model of a run's last checkpoint gives
the logits of the run's own output model, rebuilt from the checkpoint alone (its recorded recipe and model config).

Each (recipe, full/LoRA) trains once, in-process and tiny (2 steps, a checkpoint at step 2, which is the last)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import TINY_TEST_MODEL

from tunebook import load_recipe
from tunebook.errors import ConfigError, ModelError
from tunebook.models import load_adapter_model
from tunebook.run.export import export_checkpoint
from tunebook.training.manifest import write_manifest

pytestmark = pytest.mark.slow
RECIPES = ["sft", "classify", "pretrain", "dpo", "reward"]
RECORDED = [*RECIPES, "kto", "distill"]  # recipes whose checkpoints always record their recipe (the later ones)
CLASSIFIERS = ("classify", "reward")
TEXTS = ["Reverse the digits.\n1234", "Sort the digits.\n981 hello world"]


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    """`train(recipe, lora)`: the output_dir of that tiny run, trained on first use and shared by the module."""
    root, runs = tmp_path_factory.mktemp("export"), {}

    def run(recipe: str, lora: bool):
        if (recipe, lora) not in runs:
            out = root / f"{recipe}-{'lora' if lora else 'full'}"
            overrides = {
                "max_steps": 2, "save_steps": 2, "synthetic_train_size": 64, "synthetic_eval_size": 8,
                "eval_on_start": False, "disable_tqdm": True, "report_to": "none", "dataloader_num_workers": 0,
                "per_device_train_batch_size": 4, "per_device_eval_batch_size": 8, "output_dir": str(out),
                "cache_dir": str(root / "cache"), "use_peft": lora,
            }  # fmt: skip
            if recipe != "classify":  # classify builds its own tiny BERT
                overrides |= {"model_config": dict(TINY_TEST_MODEL), "max_seq_length": 64}
            if recipe == "sft":
                overrides["generation_eval"] = False
            if recipe in ("dpo", "kto"):
                overrides["sft_warmup_steps"] = 0
            if recipe == "distill":  # an untrained teacher of the student's shape
                overrides |= {"teacher_model_config": dict(TINY_TEST_MODEL), "teacher_warmup_steps": 0,
                              "generation_eval": False}  # fmt: skip
            loaded = load_recipe(recipe)
            loaded.main(loaded.config(**overrides))
            runs[recipe, lora] = out
        return runs[recipe, lora]

    return run


def _logits(model, directory):
    from transformers import AutoTokenizer

    inputs = AutoTokenizer.from_pretrained(directory)(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model.eval()(**inputs).logits


def _auto(recipe: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForSequenceClassification if recipe in CLASSIFIERS else AutoModelForCausalLM


def _assert_same_model(exported, output, exported_dir, output_dir):
    torch.testing.assert_close(_logits(exported, exported_dir), _logits(output, output_dir), rtol=0, atol=1e-5)
    assert exported.config.id2label == output.config.id2label


@pytest.mark.parametrize("recipe", RECORDED)
def test_export_of_full_weights_equals_the_run_output(train, tmp_path, recipe):
    out = train(recipe, lora=False)
    checkpoint = out / "checkpoints/step-2"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["recipe"] == recipe
    assert (checkpoint / "model_config/config.json").is_file()
    exported = export_checkpoint(checkpoint, tmp_path / "exported")
    auto = _auto(recipe)
    model, output = auto.from_pretrained(exported), auto.from_pretrained(out)
    _assert_same_model(model, output, exported, out)
    if recipe == "classify":  # the labels came from the checkpoint, not from data or a default
        assert len(model.config.id2label) == len(json.loads((out / "summary.json").read_text())["labels"]) > 2
    elif recipe == "reward":  # one output, the reward
        assert model.config.id2label == {0: "reward"} and model.config.problem_type == "regression"
    else:
        assert model.generation_config.eos_token_id == output.generation_config.eos_token_id


@pytest.mark.parametrize("recipe", RECORDED)
def test_export_of_lora_adapters_and_merged_equals_the_run_output(train, tmp_path, recipe):
    pytest.importorskip("peft")
    out = train(recipe, lora=True)
    checkpoint = out / "checkpoints/step-2"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["recipe"] == recipe
    output = load_adapter_model(out)
    adapter_dir = export_checkpoint(checkpoint, tmp_path / "adapter")
    assert (adapter_dir / "adapter_model.safetensors").is_file() and (adapter_dir / "tokenizer_config.json").is_file()
    _assert_same_model(load_adapter_model(adapter_dir), output, adapter_dir, out)
    merged_dir = export_checkpoint(checkpoint, tmp_path / "merged", merge=True)
    assert not (merged_dir / "adapter_config.json").exists()
    _assert_same_model(_auto(recipe).from_pretrained(merged_dir), output, merged_dir, out)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_checkpoint_from_before_recipes_were_recorded_still_exports(train, tmp_path, recipe):
    """No recipe in trainer_state.json, no model_config/: the recipe is told from config.yaml's keys."""
    out = train(recipe, lora=False)
    old = shutil.copytree(out / "checkpoints/step-2", tmp_path / "step-2")
    state = json.loads((old / "trainer_state.json").read_text())
    del state["recipe"]
    (old / "trainer_state.json").write_text(json.dumps(state))
    shutil.rmtree(old / "model_config")
    (old / "manifest.json").unlink()  # nor a manifest: checkpoints had one later (accepted, unverified)
    if recipe == "classify":  # the labels were found in the data, which export does not read: it says what to do
        with pytest.raises(ModelError, match="config.yaml has no label_names: add the run's labels there"):
            export_checkpoint(old, tmp_path / "exported")
        labels = json.loads((out / "summary.json").read_text())["labels"]
        text = (old / "config.yaml").read_text()
        (old / "config.yaml").write_text(text.replace("label_names: null", f"label_names: {json.dumps(labels)}"))
    exported = export_checkpoint(old, tmp_path / "exported")
    auto = _auto(recipe)
    _assert_same_model(auto.from_pretrained(exported), auto.from_pretrained(out), exported, out)


def test_the_cli_exports_a_classifier(train, tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification

    from tunebook.cli import main as cli

    out = train("classify", lora=False)
    cli(["export", str(out / "checkpoints/step-2"), str(tmp_path / "exported")])
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'exported'} from ")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "exported")
    output = AutoModelForSequenceClassification.from_pretrained(out)
    _assert_same_model(model, output, tmp_path / "exported", out)


def _rewrite(path, content) -> None:
    """Write `content` into a checkpoint's file, and its manifest anew: a checkpoint whole, but wrong inside."""
    path.write_text(json.dumps(content))
    write_manifest(next(p for p in path.parents if (p / "manifest.json").is_file()))


def test_export_errors_are_one_clear_line(train, tmp_path):
    out = train("sft", lora=False)
    with pytest.raises(ConfigError, match="is not a complete Tunebook checkpoint"):
        export_checkpoint(out, tmp_path / "x")  # the run directory, not one of its checkpoints

    bad = shutil.copytree(out / "checkpoints/step-2", tmp_path / "bad")
    state = json.loads((bad / "trainer_state.json").read_text())
    _rewrite(bad / "trainer_state.json", {**state, "recipe": "ppo"})
    with pytest.raises(ConfigError, match="unknown recipe 'ppo'"):
        export_checkpoint(bad, tmp_path / "x")

    _rewrite(bad / "trainer_state.json", state)
    model_config = json.loads((bad / "model_config/config.json").read_text())
    _rewrite(bad / "model_config/config.json", {**model_config, "hidden_size": 64})
    with pytest.raises(ModelError, match="weights do not fit the model: size mismatch"):
        export_checkpoint(bad, tmp_path / "x")
    _rewrite(bad / "model_config/config.json", {**model_config, "num_hidden_layers": 1})
    with pytest.raises(ModelError, match=r"weights do not fit the model \(missing \[\], unexpected \['model.layers.1"):
        export_checkpoint(bad, tmp_path / "x")


CUSTOM_CONFIG = """
from pathlib import Path
from transformers import LlamaConfig

Path(MARKER).write_text("the checkpoint's code ran")


class CustomConfig(LlamaConfig):
    model_type = "custom_llama"
"""
CUSTOM_MODEL = """
from transformers import LlamaForCausalLM

from .configuration_custom import CustomConfig


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
"""


def test_export_runs_a_checkpoints_own_code_only_when_the_command_line_allows_it(train, tmp_path):
    """A checkpoint whose model ships Python code (auto_map) and whose config.yaml says trust_remote_code: true:
    `tunebook export` runs that code only with --trust_remote_code, a flag of its own command line."""
    from transformers import AutoModelForCausalLM

    from tunebook.cli import main as cli

    out = train("sft", lora=False)
    marker = tmp_path / "ran"
    custom = shutil.copytree(out / "checkpoints/step-2", tmp_path / "custom")
    model_dir = custom / "model_config"
    (model_dir / "configuration_custom.py").write_text(f"MARKER = {str(marker)!r}\n{CUSTOM_CONFIG}")
    (model_dir / "modeling_custom.py").write_text(CUSTOM_MODEL)
    config = json.loads((model_dir / "config.json").read_text())
    config |= {"model_type": "custom_llama", "architectures": ["CustomForCausalLM"], "auto_map": {
        "AutoConfig": "configuration_custom.CustomConfig", "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
    }}  # fmt: skip
    (model_dir / "config.json").write_text(json.dumps(config))
    text = (custom / "config.yaml").read_text()
    (custom / "config.yaml").write_text(text.replace("trust_remote_code: false", "trust_remote_code: true"))
    assert "trust_remote_code: true" in (custom / "config.yaml").read_text()
    write_manifest(custom)  # edited on purpose: intact as far as its manifest goes

    with pytest.raises(ModelError, match="runs its own Python code .* export it with --trust_remote_code if you"):
        cli(["export", str(custom), str(tmp_path / "refused")])
    assert not marker.exists() and not (tmp_path / "refused").exists()
    cli(["export", str(custom), str(tmp_path / "exported"), "--trust_remote_code"])
    assert marker.exists()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", trust_remote_code=True)
    assert type(exported).__name__ == "CustomForCausalLM"
    _assert_same_model(exported, AutoModelForCausalLM.from_pretrained(out), tmp_path / "exported", out)


def test_export_prints_no_deepspeed_accelerator_notice(train, tmp_path):
    """DeepSpeed, where installed, is imported by `save_pretrained` (accelerate's unwrapping) and warns "Setting
    accelerator to CPU" on a machine without CUDA: true, and noise in an export (tunebook.models.quiet)."""
    pytest.importorskip("deepspeed")
    checkpoint = train("sft", lora=False) / "checkpoints/step-2"
    tunebook = str(Path(sys.executable).parent / "tunebook")
    result = subprocess.run([tunebook, "export", str(checkpoint), str(tmp_path / "model")], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "model/config.json").is_file()
    assert "Setting accelerator" not in result.stdout + result.stderr
