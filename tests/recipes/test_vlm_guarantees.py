"""The text path's guarantees, proved for image-text SFT (recipes/sft.py with a tiny vision-language model) on both
kinds of family: Qwen2-VL (as many image tokens as the picture's size needs) and LLaVA (a fixed 4 per picture).

- a stop signal mid-run, with the images decoded in a DataLoader worker: the resumed run logs the uninterrupted run's
  losses step for step and ends with its weights, byte for byte (tests/recipes/test_guarantees.py for text);
- LoRA: the output adapters, the merged folder (`merge_adapter`) and `tunebook export` of a checkpoint (adapters,
  merged, full weights) load with `AutoModelForImageTextToText` and the processor, and give the adapted model's logits
  on a real picture (tests/recipes/test_export.py and test_lora_recipes.py for text);
- a missing, unreadable or oversized image through `tunebook train`: one line naming the data file, row and image
  (`on_bad_image: error`), or the row dropped and counted in summary.json (`skip`); an image damaged past its header,
  met while a worker decodes it, is one line too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image
from recipe_runs import _records, _signal_at, _weights, _without_rates
from support import ROOT, launch
from transformers import AutoModelForImageTextToText, AutoProcessor

from tunebook import load_recipe
from tunebook.cli import main as cli
from tunebook.config.tiny import TINY_LLAVA, TINY_QWEN2_VL
from tunebook.data.image_files import open_image
from tunebook.errors import DataError
from tunebook.training.checkpoint import list_checkpoints

pytestmark = pytest.mark.slow
FAMILIES = {"qwen2_vl": TINY_QWEN2_VL, "llava": TINY_LLAVA}
# A few steps of the vlm_default task at tiny sizes; a worker decodes the images, as in a real run.
TINY_RUN = {"report_to": "none", "disable_tqdm": True, "log_level": "WARNING", "logging_steps": 1,
            "synthetic_train_size": 24, "synthetic_eval_size": 4, "per_device_train_batch_size": 4,
            "per_device_eval_batch_size": 4, "eval_on_start": False, "generation_eval": False, "max_steps": 4,
            "dataloader_num_workers": 1}  # fmt: skip


def _run(family, out, cache, **overrides):
    recipe = load_recipe("sft")
    bounds = {} if family == "qwen2_vl" else {"max_pixels": None}  # LLaVA crops to its tower's size, no bounds
    paths = {"model_config": FAMILIES[family], "output_dir": str(out), "cache_dir": str(cache)}
    config = recipe.config(ROOT / "recipes/configs/sft/vlm_default.yaml", **{**TINY_RUN, **bounds, **paths,
                                                                               **overrides})  # fmt: skip
    return recipe.main(config)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_stop_signal_then_resume_equals_the_uninterrupted_run(family, tmp_path, monkeypatch):
    # Accumulation over micro-batches of different lengths (pictures of 4 sizes) and a shuffled order, 3 steps an
    # epoch: stopped after step 4, the resumed run must pick up the loader (and its worker) at the next micro-batch
    # of the second epoch's permutation.
    common = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2, "max_steps": 5, "eval_steps": 2,
              "warmup_ratio": 0.2, "synthetic_train_size": 12}  # fmt: skip
    full = _run(family, tmp_path / "full", tmp_path / "cache", **common)
    with monkeypatch.context() as patch:
        _signal_at(patch, "sft", 4)
        with pytest.raises(SystemExit) as stopped:
            _run(family, tmp_path / "cut", tmp_path / "cache", **common)
    assert stopped.value.code == 143
    assert [p.name for p in list_checkpoints(tmp_path / "cut")] == ["step-4"]
    assert json.loads((tmp_path / "cut/checkpoints/step-4/trainer_state.json").read_text())["epoch"] == 1
    resumed = _run(family, tmp_path / "cut", tmp_path / "cache", resume_from_checkpoint="latest", **common)
    records = [(_without_rates(a), _without_rates(b)) for a, b in zip(_records(tmp_path / "full"),
                                                                        _records(tmp_path / "cut"))]  # fmt: skip
    assert len(records) == len(_records(tmp_path / "full")) == len(_records(tmp_path / "cut"))
    for reference, again in records:
        assert again == reference
    assert _weights(tmp_path / "cut") == _weights(tmp_path / "full")
    assert resumed["eval"] == full["eval"] and resumed["train_steps"] == full["train_steps"] == 5
    assert resumed["resumed_from"].endswith("step-4") and resumed["final_train_loss"] == full["final_train_loss"]


def _load_processor(family, directory):
    """AutoProcessor, as a user loads it; Qwen-VL's needs torchvision for its video processor, which this CPU
    set-up cannot import (tunebook.models.vision.load_processor builds it from its parts, images only)."""
    if family == "llava":
        return AutoProcessor.from_pretrained(directory)
    from tunebook.models.vision import load_processor

    return load_processor(str(directory))


def _inputs(processor, cache):
    """Two held-out rows of the run's generated data, as the processor turns them into model inputs."""
    data = next((cache / "synthetic").glob("shapes-*"))
    rows = [json.loads(line) for line in (data / "eval.jsonl").read_text().splitlines()[:2]]
    texts = [processor.apply_chat_template(row["messages"], tokenize=False) for row in rows]
    images = [[open_image({"path": str(data / row["images"][0]), "bytes": None})] for row in rows]
    return processor(text=texts, images=images, padding=True, return_tensors="pt")


def _logits(model, inputs):
    with torch.no_grad():
        return model.eval()(**inputs).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_outputs_merge_and_export_give_the_adapted_models_logits(family, tmp_path):
    from tunebook.models import load_adapter_model

    out, cache = tmp_path / "run", tmp_path / "cache"
    # A higher rate than the default's, so that 2 steps move the adapters visibly away from the base model.
    _run(family, out, cache, use_peft=True, merge_adapter=True, max_steps=2, save_steps=2, learning_rate=3e-2)
    processor = _load_processor(family, out / "merged")
    assert processor.chat_template and type(processor).__name__.endswith("Processor")
    inputs = _inputs(processor, cache)
    adapted = _logits(load_adapter_model(out), inputs)
    base = _logits(AutoModelForImageTextToText.from_pretrained(out / "base_model"), inputs)
    assert (adapted - base).abs().max() > 1e-3  # the adapters changed the model: the comparisons below can fail
    card = (out / "README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
    if family == "llava":  # the card's own lines load the adapters (Qwen-VL's AutoProcessor needs torchvision)
        scope, cwd = {}, os.getcwd()
        os.chdir(out.parent)  # the card names the run's folder as seen from beside it
        try:
            exec(card, scope)  # noqa: S102 - the model card this run wrote, run as a user would
        finally:
            os.chdir(cwd)
        torch.testing.assert_close(_logits(scope["model"], inputs), adapted, rtol=0, atol=0)
    assert "AutoModelForCausalLM" not in card and "AutoProcessor.from_pretrained" in card
    merged = AutoModelForImageTextToText.from_pretrained(out / "merged")
    assert type(merged).__name__.endswith("ForConditionalGeneration")
    # Merging folds B @ A into each weight: float32 rounding of a sum, a few units in the 6th digit of the logits.
    torch.testing.assert_close(_logits(merged, inputs), adapted, rtol=0, atol=1e-5)

    checkpoint = out / "checkpoints" / "step-2"
    cli(["export", str(checkpoint), str(tmp_path / "exported"), "--merge"])
    _load_processor(family, tmp_path / "exported")  # the processor travels with the export
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "exported")
    torch.testing.assert_close(_logits(exported, inputs), adapted, rtol=0, atol=1e-5)
    cli(["export", str(checkpoint), str(tmp_path / "adapter")])
    assert (tmp_path / "adapter" / "processor_config.json").is_file()
    torch.testing.assert_close(_logits(load_adapter_model(tmp_path / "adapter"), inputs), adapted, rtol=0, atol=0)


def test_export_of_full_weights_equals_the_run_output(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    _run("qwen2_vl", out, cache, max_steps=2, save_steps=2)
    cli(["export", str(out / "checkpoints" / "step-2"), str(tmp_path / "exported")])
    inputs = _inputs(_load_processor("qwen2_vl", tmp_path / "exported"), cache)
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "exported")
    assert torch.equal(_logits(exported, inputs), _logits(AutoModelForImageTextToText.from_pretrained(out), inputs))


# --------------------------------------------------------------------------------------------------------------
# Bad images, through the recipe command

BAD = {  # kind -> (how the file is damaged, the end of the line that names it)
    "missing": (lambda path: path.unlink(), "not found"),
    "unreadable": (lambda path: path.write_bytes(b"not a picture " * 20), "not an image file Pillow can read"),
    "oversized": (lambda path: Image.new("RGB", (400, 300)).save(path), "more than max_image_pixels (100,000)"),
}


def _image_data(folder, damaged: dict[int, str]) -> str:
    """12 TRL rows (one picture each, two sizes) in `folder/train.jsonl`; row i's picture damaged as `damaged[i]`."""
    folder.mkdir(parents=True, exist_ok=True)
    colours = ["red", "blue", "green"]
    rows = []
    for i in range(12):
        path = folder / f"picture-{i}.png"
        Image.new("RGB", (28 * (1 + i % 2), 28), colours[i % 3]).save(path)
        if i in damaged:
            BAD[damaged[i]][0](path) if damaged[i] in BAD else path.write_bytes(path.read_bytes()[:60])
        question = [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]
        rows.append({"messages": [{"role": "user", "content": question},
                                  {"role": "assistant", "content": colours[i % 3]}], "images": [path.name]})  # fmt: skip
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(folder / "train.jsonl")


def _train_args(data, out, on_bad_image, steps=2):
    return ["--config", "recipes/configs/sft/vlm_default.yaml", "--train_data", data, "--output_dir", str(out),
            "--cache_dir", str(out.parent / "cache"), "--max_steps", str(steps), "--per_device_train_batch_size", "4",
            "--eval_split_ratio", "0.2", "--eval_on_start", "false", "--generation_eval", "false", "--disable_tqdm",
            "true", "--report_to", "none", "--log_level", "WARNING", "--on_bad_image", on_bad_image,
            "--max_image_pixels", "100000", "--dataloader_num_workers", "1"]  # fmt: skip


@pytest.mark.parametrize("kind", BAD)
def test_a_bad_image_stops_the_run_with_one_line_naming_file_row_and_image(kind, tmp_path):
    data = _image_data(tmp_path / "data", {5: kind})
    picture = tmp_path / "data" / "picture-5.png"
    with pytest.raises(DataError) as error:
        launch("recipes/sft.py", _train_args(data, tmp_path / "run", "error"))
    assert str(error.value).startswith(f"{data}, row 6, image 1 ({picture}): ")
    assert str(error.value).endswith(BAD[kind][1]) and "\n" not in str(error.value)


def test_skip_drops_each_row_with_a_bad_image_and_counts_it_in_the_summary(tmp_path):
    data = _image_data(tmp_path / "data", {2: "missing", 5: "unreadable", 9: "oversized"})
    evaluation = _image_data(tmp_path / "eval", {0: "unreadable"})
    args = [*_train_args(data, tmp_path / "run", "skip"), "--eval_data", evaluation, "--eval_split_ratio", "0"]
    result = launch("recipes/sft.py", args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "train data: 3 rows skipped for a bad image (on_bad_image: skip), the first: " in result.stdout
    assert f"eval data: 1 rows skipped for a bad image (on_bad_image: skip), the first: {evaluation}, row 1" in (
        result.stdout
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data"]["skipped_bad_image"] == 3 and summary["data"]["examples_kept"] == 9
    assert summary["data"]["eval_skipped_bad_image"] == 1 and summary["eval"]["eval_tokens"] > 0
    assert summary["train_steps"] == 2


def test_an_image_damaged_past_its_header_is_one_line_from_the_worker_that_decodes_it(tmp_path):
    """Its header reads (the size, at preparation); the decode in the loader's worker fails. torch re-raises a
    worker's error in the training process with the worker's whole traceback as its message: Tunebook's line must
    come out as the one line it was, through `tunebook train`."""
    data = _image_data(tmp_path / "data", {5: "truncated"})
    cmd = [
        sys.executable,
        "-m",
        "tunebook.cli",
        "train",
        "--config_file",
        "accelerate_configs/cpu.yaml",
        "sft",
        *_train_args(data, tmp_path / "run", "error", steps=3),
    ]  # every training row's picture decoded
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert result.returncode == 1
    picture = tmp_path / "data" / "picture-5.png"
    assert result.stderr == (
        f"tunebook: error: {data}, row 6, image 1 ({picture}): could not be read: image file is truncated\n"
    )


@pytest.mark.multiprocess
def test_a_stop_signal_on_two_processes_then_resume_equals_the_uninterrupted_run(tmp_path):
    """SIGTERM reaches one of two processes, each with a loader worker decoding its pictures: both save at the same
    step, and the resumed 2-process run is the uninterrupted one, records and weights."""
    args = ["--config", "recipes/configs/sft/vlm_default.yaml", "--cache_dir", str(tmp_path / "cache"),
            *[f"--{k}={v}" for k, v in TINY_RUN.items() if k != "max_steps"], "--max_steps", "5",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--eval_steps", "2",
            "--synthetic_train_size", "16"]  # fmt: skip

    def run(script, out, *extra, env=None):
        return launch(script, [*args, "--output_dir", str(out), *extra], accelerate_config="multi_cpu.yaml", env=env)

    assert run("recipes/sft.py", tmp_path / "full").returncode == 0
    stopped = run("tests/recipes/signal_at_step.py", tmp_path / "cut", env={"SIGNAL_AT_STEP": "3"})
    assert stopped.returncode == 143, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    assert [p.name for p in list_checkpoints(tmp_path / "cut")] == ["step-3"]
    resumed = run("recipes/sft.py", tmp_path / "cut", "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [_without_rates(r) for r in _records(tmp_path / "cut")] == [
        _without_rates(r) for r in _records(tmp_path / "full")
    ]
    assert _weights(tmp_path / "cut") == _weights(tmp_path / "full")
