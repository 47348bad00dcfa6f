"""Outputs ready to share: the model card every run writes, push_to_hub's upload and its start-up check.

Nothing here reaches the Hub: `huggingface_hub`'s token lookup, `whoami`, `create_repo` and `create_commit` are
replaced by fakes that record what a real upload would have sent.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import yaml
from huggingface_hub import HfApi, ModelCard, RepoUrl
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects
from support import TINY_TEST_MODEL

from tunebook import load_recipe
from tunebook.errors import ConfigError
from tunebook.run.model_card import write_model_card
from tunebook.run.record import finish_run
from tunebook.run.upload import UPLOAD_IGNORE_PATTERNS, check_hub_access, push_output_dir

SUMMARY = {
    "recipe": "sft",
    "train_steps": 120,
    "train_tokens": 345678,
    "train_runtime_seconds": 61.25,
    "final_train_loss": 0.8123,
    "eval": {"eval_loss": 0.9531, "eval_exact_match": 0.875},
    "eval_before_training": {"eval_loss": 3.2109, "eval_exact_match": 0.0},
    "num_processes": 2,
    "mixed_precision": "bf16",
    "versions": {"tunebook": "0.1.0", "torch": "2.13.0", "transformers": "5.23.0", "peft": "0.21.2"},
}


def _config(**overrides) -> dict:
    config = {
        "model_name_or_path": "org/base-model",
        "use_peft": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.05,
        "lora_target_modules": "all-linear",
        "learning_rate": 2e-4,
        "lr_scheduler_type": "cosine",
        "warmup_ratio": 0.03,
        "max_steps": 120,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 8,
        "max_seq_length": 2048,
        "packing": True,
        "seed": 42,
    }
    return {**config, **overrides}


def test_model_card_of_a_lora_run_on_hub_and_local_data(tmp_path):
    out = tmp_path / "run"
    (out / "merged").mkdir(parents=True)
    (out / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base-model"}))
    (out / "merged/config.json").write_text("{}")
    local = tmp_path / "extra.jsonl"
    config = _config(
        train_data=[
            {"path": "HuggingFaceH4/ultrachat_200k", "split": "train_sft", "weight": 0.5},
            {"path": str(local), "samples": 2000},
        ],
        eval_data={"path": "HuggingFaceH4/ultrachat_200k", "split": "test_sft", "revision": "abc123"},
        merge_adapter=True,
    )
    path = write_model_card(out, SUMMARY, config)

    assert path == out / "README.md"
    data = ModelCard.load(path).data
    assert data.library_name == "peft"
    assert data.base_model == "org/base-model"
    assert data.datasets == ["HuggingFaceH4/ultrachat_200k"]  # once, though used for training and evaluation
    assert data.tags == ["tunebook", "sft"]
    assert data.pipeline_tag == "text-generation"
    text = path.read_text()
    for shown in [
        "split `train_sft`, weight 0.5",
        "`../extra.jsonl` (local): its only split, 2,000 rows sampled",  # relative to the run: no machine paths
        "split `test_sft`, revision `abc123`",
        "| eval_exact_match | 0 | 0.875 |",
        "| eval_loss | 3.2109 | 0.9531 |",
        "| final_train_loss | 0.8123 |",
        "| train_tokens | 345,678 |",
        "| train_runtime | 61.2 s |",
        "4 per process x 8 accumulation steps x 2 process(es) = 64",
        "r 8, alpha 16",
        "bf16 mixed precision",
        "AutoPeftModelForCausalLM.from_pretrained",
        "- Tunebook 0.1.0",
        "- peft 0.21.2",
    ]:
        assert shown in text, shown

    # merge_adapter: the merged plain model gets its own card, for transformers.
    merged = ModelCard.load(out / "merged/README.md")
    assert merged.data.library_name == "transformers" and merged.data.base_model == "org/base-model"
    assert 'AutoModelForCausalLM.from_pretrained("' in merged.text


def test_model_card_of_a_classifier_from_the_hub_cache_and_of_a_synthetic_run(tmp_path):
    snapshot = tmp_path / "hub/models--org--encoder/snapshots/0123abc"
    snapshot.mkdir(parents=True)
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"id2label": {"0": "sports", "1": "science"}}))
    config = _config(model_name_or_path=str(snapshot), use_peft=False, hub_model_id="me/topics", max_steps=-1,
                     num_train_epochs=2.0)  # fmt: skip
    write_model_card(out, {**SUMMARY, "recipe": "classify"}, config)
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers"
    assert card.data.base_model == "org/encoder"  # the Hub name of the cache folder it was loaded from
    assert card.data.pipeline_tag == "text-classification" and card.data.tags == ["tunebook", "classify"]
    assert card.data.datasets is None
    assert "synthetic task" in card.text and "**Labels**: sports, science" in card.text
    assert "| num_train_epochs | 2 |" in card.text
    assert 'AutoModelForSequenceClassification.from_pretrained("me/topics")' in card.text


@pytest.fixture
def fake_hub(monkeypatch):
    """huggingface_hub online with a token, whose uploads are recorded instead of sent."""
    calls = {}
    # Read once at import (conftest turned offline mode on): the attribute is what Tunebook checks.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_fake")

    def whoami(self, token=None, **kwargs):
        calls["whoami"] = token
        return {"name": "me", "orgs": [{"name": "lab"}], "auth": {"accessToken": {"role": "write"}}}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = (repo_id, kwargs)
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, *, repo_id, operations, **kwargs):
        # What the commit would send: each file's path in the repository and its bytes.
        calls["sent"] = {op.path_in_repo: _bytes(op.path_or_fileobj) for op in operations}
        calls["uploaded"] = sorted(calls["sent"])
        calls["repo_id"] = repo_id

    monkeypatch.setattr(HfApi, "whoami", whoami)
    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    return calls


def _bytes(source) -> bytes:
    return source if isinstance(source, bytes) else Path(source).read_bytes()


def _tiny_sft_config(tmp_path, **overrides):
    return load_recipe("sft").config(
        max_steps=2, synthetic_train_size=64, synthetic_eval_size=8, generation_eval=False, eval_on_start=False,
        disable_tqdm=True, dataloader_num_workers=0, per_device_train_batch_size=4, model_config=dict(TINY_TEST_MODEL),
        output_dir=str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"), push_to_hub=True, hub_model_id="me/tiny",
        **overrides,
    )  # fmt: skip


def test_a_run_with_push_to_hub_uploads_the_model_and_card_but_no_checkpoints_or_tracker_files(tmp_path, fake_hub):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".env").write_text("HF_TOKEN=hf_secret\n")  # output_dir: a project folder, say: never uploaded
    (out / "train.log").write_text("a console log\n")
    config = _tiny_sft_config(tmp_path, save_steps=1, report_to="tensorboard")
    load_recipe("sft").main(config)

    assert fake_hub["whoami"] == "hf_fake"  # checked at start-up
    assert fake_hub["create_repo"] == ("me/tiny", {"private": None, "exist_ok": True, "repo_type": "model"})
    assert fake_hub["repo_id"] == "me/tiny"
    uploaded = fake_hub["uploaded"]
    all_files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    # Exactly what `upload_folder` with the same ignore patterns would have sent.
    patterns = [*UPLOAD_IGNORE_PATTERNS, *DEFAULT_IGNORE_PATTERNS]
    assert uploaded == sorted(filter_repo_objects(all_files, ignore_patterns=patterns))
    # The run left checkpoints and tensorboard files beside the model: they are there, and stay home.
    assert any(f.startswith("checkpoints/step-2/") for f in all_files)
    assert any(f.startswith("runs/sft/") for f in all_files)
    assert ".env" in all_files and "train.log" in all_files
    assert not [f for f in uploaded if f.startswith(("checkpoints/", "runs/", ".")) or f.endswith(".log")]
    expected = {"README.md", "model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                "config.yaml", "summary.json", "metrics.jsonl", "report.png"}  # fmt: skip
    assert expected <= set(uploaded)
    for name, sent in fake_hub["sent"].items():  # the run's absolute paths stay home (config, summary, card...)
        if name.endswith((".json", ".jsonl", ".yaml", ".md", ".txt", ".jinja")):
            assert str(tmp_path) not in sent.decode(), name
    assert json.loads((out / "summary.json").read_text())["output_dir"] == str(out)  # the local one as it was
    card = ModelCard.load(out / "README.md")
    assert card.data.tags == ["tunebook", "sft"] and card.data.base_model is None
    assert "synthetic task" in card.text and 'AutoModelForCausalLM.from_pretrained("me/tiny")' in card.text


@pytest.mark.parametrize("problem", ["offline", "no token"])
def test_push_to_hub_without_hub_access_stops_at_start_up(tmp_path, monkeypatch, problem):
    if problem == "no token":
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    # else: conftest's HF_HUB_OFFLINE=1
    with pytest.raises(ConfigError) as error:
        load_recipe("sft").main(_tiny_sft_config(tmp_path))
    message = str(error.value)
    assert "\n" not in message and ("offline mode" if problem == "offline" else "no Hugging Face token") in message
    assert not (tmp_path / "out/metrics.jsonl").exists() and not (tmp_path / "out/model.safetensors").exists()


def test_the_start_up_check_names_what_the_token_cannot_do(monkeypatch, fake_hub):
    config = SimpleNamespace(push_to_hub=True, hub_model_id="lab/tiny")
    check_hub_access(config)  # an organisation of the user
    monkeypatch.setattr(
        HfApi, "whoami", lambda self, token=None: {"name": "me", "auth": {"accessToken": {"role": "read"}}}
    )
    with pytest.raises(ConfigError, match="read-only"):
        check_hub_access(config)
    monkeypatch.setattr(HfApi, "whoami", lambda self, token=None: {"name": "me", "orgs": []})
    with pytest.raises(ConfigError, match="'lab' is neither the token's user"):
        check_hub_access(config)

    def unreachable(self, token=None):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(HfApi, "whoami", unreachable)
    with pytest.raises(ConfigError, match="cannot reach the Hugging Face Hub"):
        check_hub_access(config)
    check_hub_access(SimpleNamespace(push_to_hub=False, hub_model_id=None))  # nothing to check
    with pytest.raises(ConfigError, match="push_to_hub needs hub_model_id"):
        load_recipe("sft").config(push_to_hub=True)


def test_a_failed_upload_or_card_is_logged_and_the_run_keeps_its_outputs(tmp_path, monkeypatch, fake_hub, caplog):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")

    def refused(self, **kwargs):
        raise RuntimeError("403 Forbidden")

    monkeypatch.setattr(HfApi, "create_commit", refused)
    with caplog.at_level(logging.INFO, logger="tunebook"):
        assert push_output_dir(out, {"hub_model_id": "me/tiny"}) is None
    assert "push_to_hub failed (403 Forbidden)" in caplog.text and f"hf upload me/tiny {out} ." in caplog.text

    def broken(*args):
        raise ValueError("no card today")

    monkeypatch.setattr("tunebook.run.model_card.write_model_card", broken)
    (out / "config.yaml").write_text("learning_rate: 0.001\n")
    with caplog.at_level(logging.INFO, logger="tunebook"):
        finish_run(out, {"recipe": "sft", "train_steps": 0})
    assert "README.md (model card) not written: no card today" in caplog.text
    assert (out / "summary.json").is_file()


def test_a_lora_base_from_the_hub_cache_is_recorded_by_its_hub_name(tmp_path, tiny_tokenizer, tiny_model_config):
    from transformers import AutoModelForCausalLM

    from tunebook.config import SFTConfig
    from tunebook.models import apply_lora, build_causal_lm
    from tunebook.models.lora import _base_model_path

    snapshot = tmp_path / "models--org--tiny/snapshots/0123abc"
    plain = tmp_path / "tiny"
    model = build_causal_lm(tiny_tokenizer, model_config=tiny_model_config)
    for folder in (snapshot, plain):
        model.save_pretrained(folder)
    lora = SFTConfig(use_peft=True, lora_r=4, lora_alpha=8)
    from_cache = apply_lora(AutoModelForCausalLM.from_pretrained(snapshot), lora)
    assert _base_model_path(from_cache, tmp_path / "out") == ("org/tiny", "0123abc")  # pinned to the commit
    from_folder = apply_lora(AutoModelForCausalLM.from_pretrained(plain), lora)
    assert _base_model_path(from_folder, tmp_path / "out") == (str(plain.resolve()), None)
    assert not (tmp_path / "out/base_model").exists()  # neither needed a copy of the base


def test_the_card_and_the_uploaded_config_name_no_absolute_path_of_this_machine(tmp_path, fake_hub):
    """Local data, a base model from the Hugging Face cache, a reward file, an absolute output_dir and cache: the card
    and the uploaded config.yaml show Hub names and paths relative to the run, which lead to the same files; the
    local config.yaml keeps its absolute paths (it reproduces and resumes the run on this machine)."""
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text(json.dumps({"prompt": "Reverse the digits.\n12", "completion": "21"}) + "\n")
    snapshot = tmp_path / "hub/models--org--base/snapshots/0123abc"
    snapshot.mkdir(parents=True)
    out = tmp_path / "runs" / "sft-1"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    config = _config(use_peft=False, model_name_or_path=str(snapshot), output_dir=str(out),
                     cache_dir=str(tmp_path / "cache"), train_data=[{"path": str(data), "weight": 1.0}],
                     eval_data=str(data), hub_model_id="me/tiny", push_to_hub=True,
                     chat_template="{% for m in messages %}/{{ m.content }}/{% endfor %}")  # fmt: skip
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    card = write_model_card(out, SUMMARY, config).read_text()
    push_output_dir(out, config)
    shared = yaml.safe_load(fake_hub["sent"]["config.yaml"])
    for text in (card, fake_hub["sent"]["config.yaml"].decode()):
        assert str(tmp_path) not in text, text
    assert "`../../data/train.jsonl` (local)" in card and "[org/base](https://huggingface.co/org/base)" in card
    assert shared["model_name_or_path"] == "org/base" and shared["output_dir"] == "."
    assert shared["train_data"] == [{"path": "../../data/train.jsonl", "weight": 1.0}]
    assert (out / shared["eval_data"]).resolve() == data and (
        out / shared["cache_dir"]
    ).resolve() == tmp_path / "cache"
    assert shared["chat_template"] == config["chat_template"] and shared["hub_model_id"] == "me/tiny"
    assert yaml.safe_load((out / "config.yaml").read_text())["train_data"][0]["path"] == str(data)
    assert fake_hub["sent"]["README.md"].decode() == card


def test_shareable_paths(tmp_path):
    from tunebook.run.upload import shareable_path

    rewards = tmp_path / "rewards.py"
    rewards.write_text("def f(prompts, completions, **kw): return [0.0] * len(completions)\n")
    out = tmp_path / "out"
    assert shareable_path(f"{rewards}:f", out) == "../rewards.py:f"
    assert shareable_path(str(out), out) == "."
    assert shareable_path(str(tmp_path / "gone" / "step-3"), out) == "../gone/step-3"  # need not exist
    for unchanged in ("exact_match", "org/name", "data/train.jsonl", "^/\\d+$", "/(\\d+)/", "{{ '/' }}\n"):
        assert shareable_path(unchanged, out) == unchanged


def test_the_card_shows_the_sample_replies_before_training_and_at_the_last_evaluation(tmp_path):
    records = [
        {"step": 0, "eval_loss": 3.0, "samples": [{"prompt": "12345", "completion": "��"}, {"prompt": "a\nb", "completion": ""}]},
        {"step": 5, "loss": 2.0},
        {"step": 10, "eval_loss": 1.0, "samples": [{"prompt": "12345", "completion": "54321"}, {"prompt": "a\nb", "completion": "c"}]},
        {"step": 20, "eval_loss": 0.5, "samples": [{"prompt": "12345", "completion": "54321"}, {"prompt": "a\nb", "completion": "b a"}]},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    card = write_model_card(tmp_path, SUMMARY, _config(use_peft=False)).read_text()
    assert "## Sample generations" in card
    assert (
        "| prompt | before training | step 20 |\n|---|---|---|\n| 12345 | �� | 54321 |\n| a ⏎ b | *(empty)* | b a |"
        in card
    )
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records[1]) + "\n")
    assert "Sample generations" not in write_model_card(tmp_path, SUMMARY, _config(use_peft=False)).read_text()


def test_the_load_line_fits_what_the_run_saved(tmp_path):
    from tunebook.run.model_card import load_line

    out = tmp_path / "run"
    out.mkdir()
    assert load_line(out, "sft") is None  # nothing saved (max_steps 0)
    (out / "config.json").write_text("{}")
    assert load_line(out, "sft", "outputs/sft") == (
        'from transformers import AutoModelForCausalLM; model = AutoModelForCausalLM.from_pretrained("outputs/sft")'
    )
    assert "AutoModelForSequenceClassification.from_pretrained" in load_line(out, "reward")  # classify too
    (out / "config.json").unlink()
    (out / "adapter_config.json").write_text("{}")  # LoRA adapters: peft loads the base, then them
    assert load_line(out, "classify", "o") == (
        'from peft import AutoPeftModelForSequenceClassification; model = AutoPeftModelForSequenceClassification.from_pretrained("o")'
    )
    (out / "adapter_config.json").write_text('{"base_model_name_or_path": "../base"}')  # portable, relative
    assert (
        load_line(out, "sft", "o") == 'from tunebook.models import load_adapter_model; model = load_adapter_model("o")'
    )
    (out / "merged").mkdir()
    (out / "merged" / "config.json").write_text("{}")  # merged too: the plain model is the one to load
    assert load_line(out, "dpo", "o").endswith('AutoModelForCausalLM.from_pretrained("o/merged")')


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ({}, "Fine-tuned: the language model and the projector (vision features -> language model); the vision tower "
             "kept its weights."),
        ({"freeze_projector": True}, "Fine-tuned: the language model; the vision tower and the projector kept their "
                                     "weights."),
        ({"freeze_vision_tower": False}, "Fine-tuned: the language model and the projector (vision features -> "
                                         "language model) and the vision tower."),
    ],
)  # fmt: skip
def test_a_vision_language_models_card_says_which_parts_trained(tmp_path, keys, says):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "processor_config.json").write_text("{}")  # saved with its processor: a vision-language model
    config = _config(use_peft=False, packing=False, **keys)
    write_model_card(tmp_path, SUMMARY, config)
    card = ModelCard.load(tmp_path / "README.md")
    assert says in card.text and "All weights fine-tuned" not in card.text
    assert card.data.pipeline_tag == "image-text-to-text"
