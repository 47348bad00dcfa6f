"""The model card (`README.md`) written into every output directory, from the run's `config.yaml` and summary:
what was trained from what data, its settings and results, and how to load it. `finish_run` writes it; with
`push_to_hub` the upload (`tunebook.run.upload`) follows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import huggingface_hub

from ..data.sources import DataSource, parse_sources
from ..errors import ConfigError
from ..locations import PACKAGE_PREFIX, hub_name_of_snapshot, looks_like_local_path
from ..models.lora import BASE_MODEL_DIR
from ..recipe import recipe_task
from .report import format_cell, read_metrics
from .upload import has_model, shareable_config, shareable_path

__all__ = ["load_line", "write_model_card"]


# --------------------------------------------------------------------------------------------------------------
# Model card


def write_model_card(output_dir: str | Path, summary: dict[str, Any], config: dict[str, Any]) -> Path:
    """Write `output_dir/README.md`: Hub metadata, then what the model is, its data, settings, final metrics, how
    to load it and the library versions. A LoRA run with `merge_adapter` also gets one in `output_dir/merged/`.

    Args:
        output_dir: the run's output directory, with the saved model (if any) in it.
        summary: the run's summary (`summary.json`).
        config: the resolved config (`config.yaml`) as a dict.
    """
    output_dir = Path(output_dir)
    lora = bool(config.get("use_peft"))
    config = shareable_config(config, output_dir)  # a card is for sharing: no absolute paths of this machine
    _card(output_dir, output_dir, summary, config, lora=lora).save(output_dir / "README.md")
    merged = output_dir / "merged"
    if lora and config.get("merge_adapter") and (merged / "config.json").is_file():
        _card(merged, output_dir, summary, config, lora=False, merged=True).save(merged / "README.md")
    return output_dir / "README.md"


def load_line(output_dir: str | Path, recipe: str, shown_as: str | None = None) -> str | None:
    """One line of Python that loads the model a run saved in `output_dir`, or None when it saved none: the Auto
    class of its task (sequence classification for classify and reward), peft's for LoRA adapters, and the plain
    model in `merged/` when a LoRA run merged its adapters. `shown_as`: the folder as the line names it (the
    config's `output_dir` as the user typed it; by default `output_dir`)."""
    output_dir, shown_as = Path(output_dir), shown_as or str(output_dir)
    classify = (recipe_task(recipe) or ("", ""))[1] == "text-classification"
    task = "SequenceClassification" if classify else "CausalLM"
    if (output_dir / "processor_config.json").is_file():  # a vision-language model, saved with its processor
        task = "ImageTextToText"
    if (output_dir / "merged" / "config.json").is_file():
        library, auto, path = "transformers", f"AutoModelFor{task}", (Path(shown_as) / "merged").as_posix()
    elif (output_dir / "adapter_config.json").is_file():  # loads the base model, then the adapters
        library, auto, path = "peft", f"AutoPeftModelFor{task}", shown_as
        base = json.loads((output_dir / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
        # A local base recorded relative to the adapters: peft would read it from the cwd. A vision-language base:
        # peft has no AutoPeftModelForImageTextToText (0.21), load_adapter_model loads it as one.
        if base.startswith(".") or task == "ImageTextToText":
            library, auto = "tunebook.models", "load_adapter_model"
            return f"from {library} import {auto}; model = {auto}({json.dumps(path)})"
    elif (output_dir / "config.json").is_file():
        library, auto, path = "transformers", f"AutoModelFor{task}", shown_as
    else:
        return None
    return f"from {library} import {auto}; model = {auto}.from_pretrained({json.dumps(path)})"


def _card(model_dir: Path, output_dir: Path, summary, config, *, lora: bool, merged: bool = False):
    recipe = summary.get("recipe") or "run"
    what, pipeline_tag = recipe_task(recipe) or (f"a Tunebook `{recipe}` run", "text-generation")
    if _is_vision(model_dir, output_dir):
        pipeline_tag = "image-text-to-text"
    train, evaluation = _sources(config)
    hub_datasets = list(dict.fromkeys(n for n in map(_hub_dataset, train + evaluation) if n))
    data = huggingface_hub.ModelCardData(
        library_name="peft" if lora else "transformers",
        base_model=_hub_model(config.get("model_name_or_path")),
        datasets=hub_datasets or None,
        tags=["tunebook", recipe],
        pipeline_tag=pipeline_tag,
        **_model_index(summary, config.get("hub_model_id") or output_dir.name),
    )
    ref = config.get("hub_model_id") or _local_ref(model_dir, output_dir, config)  # from the Hub, or this folder
    title = f"{config.get('hub_model_id') or output_dir.name}{' (merged)' if merged else ''}"
    sections = [
        f"# {title}",
        _about(model_dir, output_dir, recipe, what, config, lora, merged),
        "## Data\n\n" + _data_text(config, train, evaluation),
        "## Training settings\n\n" + _settings_text(summary, config, lora or merged),
        "## Results\n\n" + _results_text(summary),
        *_harness_section(summary),
        *_samples_section(output_dir),
        "## How to load\n\n" + _load_text(model_dir, output_dir, ref, recipe, config, lora, merged),
        "## Framework versions\n\n" + _versions_text(summary),
    ]
    return huggingface_hub.ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n")


def _is_vision(model_dir: Path, output_dir: Path) -> bool:
    """A vision-language model: saved with its processor (`recipes/sft.py` saves one for no other model)."""
    return any((d / "processor_config.json").is_file() for d in (model_dir, output_dir))


def _vision_parts_text(config) -> str:
    """Which parts of a vision-language model trained, from the run's freeze_* keys (full fine-tuning)."""
    tower, projector = config.get("freeze_vision_tower", True), config.get("freeze_projector", False)
    trained = ["the language model"] + ([] if projector else ["the projector (vision features -> language model)"])
    if not tower:
        trained.append("the vision tower")
    kept = [name for name, frozen in (("the vision tower", tower), ("the projector", projector)) if frozen]
    text = f"Fine-tuned: {' and '.join(trained)}"
    return text + (f"; {' and '.join(kept)} kept {'its' if len(kept) == 1 else 'their'} weights." if kept else ".")


def _about(model_dir: Path, output_dir: Path, recipe, what, config, lora: bool, merged: bool) -> str:
    lines = [f"Trained with [Tunebook](https://github.com/tunebook/tunebook)'s `{recipe}` recipe: {what}."]
    if merged:
        lines.append("LoRA adapters trained on the frozen base, then folded into its weights: a plain model (the "
                     "adapters themselves are in the parent folder).")  # fmt: skip
    elif lora:
        lines.append("LoRA adapters on a frozen base model (a peft adapter directory).")
    elif _is_vision(model_dir, output_dir):
        lines.append(_vision_parts_text(config))
    else:
        lines.append("All weights fine-tuned (a full model).")
    lines.append(f"- **Base model**: {_base_text(config)}")
    lines.append(f"- **Tokenizer**: {_tokenizer_text(config)}")
    if labels := _labels(model_dir):
        lines.append(f"- **Labels**: {', '.join(labels)}")
    if not has_model(model_dir):
        lines.append("\nNo model was saved in this directory (`max_steps: 0` only evaluates).")
    return "\n\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:])


def _base_text(config) -> str:
    name = config.get("model_name_or_path")
    if name:
        hub = _hub_model(name)
        if hub:
            return f"[{hub}](https://huggingface.co/{hub})"
        if name.startswith(PACKAGE_PREFIX):
            return f"`{name}` (the model the pip package {name.removeprefix(PACKAGE_PREFIX).split('/')[0]} installs)"
        return f"`{name}` (a local folder)"
    model_config = config.get("model_config")
    if isinstance(model_config, dict):
        return f"none: built from a config, randomly initialised (`{json.dumps(model_config, sort_keys=True)}`)"
    if model_config:
        return f"none: built from the config `{model_config}`, randomly initialised"
    return "none: the recipe's tiny default model, built from a config and randomly initialised"


def _tokenizer_text(config) -> str:
    if name := config.get("tokenizer_name_or_path"):
        return f"`{name}`"
    if config.get("model_name_or_path"):
        return "the base model's"
    size = config.get("tokenizer_vocab_size")
    return f"trained on the training data by the recipe ({size:,}-token vocabulary)" if size else "trained on the data"


def _sources(config) -> tuple[list[DataSource], list[DataSource]]:
    return parse_sources(config.get("train_data"), "train_data"), parse_sources(config.get("eval_data"), "eval_data")


def _data_text(config, train: list[DataSource], evaluation: list[DataSource]) -> str:
    if not train:
        sizes = f"{config.get('synthetic_train_size', '?')} training examples"
        text = f"Training: a synthetic task the recipe generated itself ({sizes}, seed {config.get('seed', '?')})."
        if not evaluation:
            return text + f" Evaluation: {config.get('synthetic_eval_size', '?')} held-out examples of the same task."
    else:
        text = "Training:\n\n" + "\n".join(map(_source_line, train))
    if evaluation:
        return text + "\n\nEvaluation:\n\n" + "\n".join(map(_source_line, evaluation))
    ratio = config.get("eval_split_ratio") or 0
    return text + (
        f"\n\nEvaluation: {ratio:.1%} of the training data, held out." if ratio else "\n\nNo evaluation data."
    )


def _source_line(source: DataSource) -> str:
    hub = _hub_dataset(source)
    line = f"- [{hub}](https://huggingface.co/datasets/{hub})" if hub else f"- `{source.path}` (local)"
    split = f"split `{source.split}`" if source.split else "its only split"
    details = [f"config `{source.name}`" if source.name else None, split]
    details += [f"revision `{source.revision}`" if source.revision else None]
    details += [f"data_dir `{source.data_dir}`" if source.data_dir else None]
    details += [f"data_files `{source.data_files}`" if source.data_files else None]
    if source.samples is not None:
        details.append(f"{source.samples:,} rows sampled")
    elif source.weight != 1.0:
        details.append(f"weight {source.weight:g}")
    return line + ": " + ", ".join(d for d in details if d)


def _settings_text(summary, config, lora: bool) -> str:
    processes = summary.get("num_processes") or 1
    micro = config.get("per_device_train_batch_size") or 0
    accumulation = config.get("gradient_accumulation_steps") or 1
    schedule = (
        f"{config.get('lr_scheduler_type', '?')} schedule, warmup_ratio {format_cell(config.get('warmup_ratio'))}"
    )
    max_steps = config.get("max_steps", -1)
    length = ("max_steps", max_steps) if max_steps != -1 else ("num_train_epochs", config.get("num_train_epochs"))
    rows = [
        ("learning_rate", f"{format_cell(config.get('learning_rate'))} ({schedule})"),
        (length[0], format_cell(length[1])),
        ("batch size", f"{micro} per process x {accumulation} accumulation steps x {processes} process(es) = "
                       f"{micro * accumulation * processes}"),
        ("max_seq_length", format_cell(config.get("max_seq_length"))),
    ]  # fmt: skip
    if "packing" in config:
        rows.append(("packing", format_cell(config["packing"])))
    if lora:
        targets = config.get("lora_target_modules")
        rows.append(("LoRA", f"r {config.get('lora_r')}, alpha {format_cell(config.get('lora_alpha'))}, dropout "
                             f"{format_cell(config.get('lora_dropout'))}, target modules {format_cell(targets)}"))  # fmt: skip
    precision = summary.get("mixed_precision") or "?"
    rows.append(("precision", "fp32 (no mixed precision)" if precision == "no" else f"{precision} mixed precision"))
    if config.get("load_in_4bit"):
        rows[-1] = ("precision", rows[-1][1] + ", base weights in 4-bit NF4 (QLoRA)")
    rows += [("weight_decay", format_cell(config.get("weight_decay"))), ("seed", format_cell(config.get("seed")))]
    return _table(["setting", "value"], rows) + "\n\nThe whole resolved config is `config.yaml`."


def _results_text(summary) -> str:
    after, before = summary.get("eval") or {}, summary.get("eval_before_training") or {}
    parts = []
    if after or before:
        keys = list(dict.fromkeys([*after, *before]))
        parts.append(_table(["metric", "before training", "after training"],
                            [(k, format_cell(before.get(k)), format_cell(after.get(k))) for k in keys]))  # fmt: skip
    runtime = summary.get("train_runtime_seconds")
    rows = [
        ("final_train_loss", format_cell(summary.get("final_train_loss"))),
        ("train_steps", format_cell(summary.get("train_steps"))),
        ("train_tokens", format_cell(summary.get("train_tokens"))),
        ("train_runtime", "-" if runtime is None else f"{runtime:,.1f} s"),
    ]
    best = summary.get("best") or {}
    if best.get("best_checkpoint") and best.get("best_step") is not None:
        rows.append(
            ("best", f"{best.get('metric')} {format_cell(best.get('best_value'))} at step {best['best_step']}")
        )
    parts.append(_table(["training", ""], rows))
    parts.append("Every logged step and evaluation is in `metrics.jsonl`, the summary in `summary.json`.")
    return "\n\n".join(parts)


def _harness_section(summary) -> list[str]:
    """The lm-evaluation-harness figures of the final model (`eval_harness_tasks`), or nothing."""
    harness = summary.get("eval_harness") or {}
    if not harness.get("tasks"):
        return []
    rows = [(task, metric, format_cell(value), format_cell(harness.get("documents", {}).get(task)),
             format_cell(harness.get("num_fewshot", {}).get(task)))
            for task, metrics in harness["tasks"].items() for metric, value in metrics.items()]  # fmt: skip
    how = "in the tokenizer's chat template" if harness.get("chat_template") else "as plain text"
    intro = (
        f"lm-evaluation-harness {harness.get('lm_eval_version', '')} on the final weights, prompts {how} "
        "(`tunebook evaluate` repeats it on the saved model; docs/evaluation.md says where such figures can "
        "differ from the harness's defaults)."
    )
    return ["## Benchmarks\n\n" + intro + "\n\n" + _table(["task", "metric", "value", "documents", "few-shot"], rows)]


def _model_index(summary, name: str) -> dict[str, Any]:
    """The card's `model-index` (the Hub's evaluation results) from the harness figures, or nothing."""
    harness = summary.get("eval_harness") or {}
    results = [
        huggingface_hub.EvalResult(task_type="text-generation", dataset_type=task, dataset_name=task,
                                   metric_type=metric, metric_value=value, source_name="lm-evaluation-harness",
                                   source_url="https://github.com/EleutherAI/lm-evaluation-harness")
        for task, metrics in (harness.get("tasks") or {}).items() for metric, value in metrics.items()
    ]  # fmt: skip
    return {"model_name": name, "eval_results": results} if results else {}


def _samples_section(output_dir: Path) -> list[str]:
    """The replies to `sample_prompts` at the first and the last evaluation (from metrics.jsonl), or nothing."""
    try:
        sampled = [r for r in read_metrics(output_dir)[1] if r.get("samples")]
    except ConfigError:  # no metrics.jsonl (a card written for a folder that is not a run's): no section
        return []
    if not sampled:
        return []
    shown = [sampled[0], sampled[-1]] if len(sampled) > 1 else sampled[:1]
    header = ["prompt", *("before training" if r["step"] == 0 else f"step {r['step']}" for r in shown)]
    replies = [{s["prompt"]: s["completion"] for s in r["samples"]} for r in shown]
    rows = [
        (_one_line(s["prompt"]), *(_one_line(r.get(s["prompt"], "")) for r in replies)) for s in shown[-1]["samples"]
    ]
    intro = "Greedy replies to `sample_prompts` (every evaluation's are in `metrics.jsonl`)."
    return [f"## Sample generations\n\n{intro}\n\n" + _table(header, rows)]


def _one_line(text: str) -> str:
    return text.replace("\n", " ⏎ ") or "*(empty)*"  # a reply that ended its turn at once


def _load_text(model_dir: Path, output_dir: Path, ref: str, recipe: str, config, lora: bool, merged: bool) -> str:
    if not has_model(model_dir):
        return "No model to load: this run saved none."
    on_hub = bool(config.get("hub_model_id"))
    subfolder = ', subfolder="merged"' if merged and on_hub else ""
    classify = (recipe_task(recipe) or ("", ""))[1] == "text-classification"  # classify and reward
    auto = "AutoModelForSequenceClassification" if classify else "AutoModelForCausalLM"
    vision = (model_dir / "processor_config.json").is_file()  # a vision-language model and its processor
    if not lora and vision:
        code = ("from transformers import AutoModelForImageTextToText, AutoProcessor\n\n"
                f'model = AutoModelForImageTextToText.from_pretrained("{ref}"{subfolder})\n'
                f'processor = AutoProcessor.from_pretrained("{ref}"{subfolder})  # without torchvision: '
                "tunebook.models.vision.load_processor")  # fmt: skip
        return f"```python\n{code}\n```"
    if not lora:
        task = "text-classification" if classify else "text-generation"
        code = (f"from transformers import {auto}, AutoTokenizer, pipeline\n\n"
                f'model = {auto}.from_pretrained("{ref}"{subfolder})\n'
                f'tokenizer = AutoTokenizer.from_pretrained("{ref}"{subfolder})\n'
                f'pipe = pipeline("{task}", model=model, tokenizer=tokenizer)')  # fmt: skip
        return f"```python\n{code}\n```"
    base = _adapter_base(model_dir)
    tokenizer = f'tokenizer = AutoTokenizer.from_pretrained("{ref}")'
    if vision:  # its adapters on the base loaded as a vision-language model, and the processor for the pictures
        code = ("from tunebook.models import load_adapter_model\nfrom transformers import AutoProcessor\n\n"
                f'model = load_adapter_model("{ref}")  # loads the base model, then the adapters\n'
                f'processor = AutoProcessor.from_pretrained("{ref}")  # without torchvision: '
                "tunebook.models.vision.load_processor")  # fmt: skip
        return f"```python\n{code}\n```"
    if not looks_like_local_path(base):  # a Hub base, which AutoPeftModel finds from anywhere
        peft_auto = "AutoPeftModelForSequenceClassification" if classify else "AutoPeftModelForCausalLM"
        code = (f"from peft import {peft_auto}\nfrom transformers import AutoTokenizer\n\n"
                f'model = {peft_auto}.from_pretrained("{ref}")  # loads the base model, then the adapters\n'
                f"{tokenizer}")  # fmt: skip
        return f"```python\n{code}\n```"
    # A local base is recorded relative to the adapter directory (tunebook.models.lora.recorded_base), which
    # AutoPeftModel would resolve against the current directory: the snippet loads the base itself.
    resolved = (model_dir / base).resolve()
    saved = resolved == (output_dir / BASE_MODEL_DIR).resolve()
    if not on_hub:
        code = (f"from peft import PeftModel\nfrom transformers import {auto}, AutoTokenizer\n\n"
                f'base = {auto}.from_pretrained("{os.path.normpath(Path(ref) / base)}")\n'
                f'model = PeftModel.from_pretrained(base, "{ref}")\n{tokenizer}')  # fmt: skip
        return f"```python\n{code}\n```"
    base_load = f'"{ref}", subfolder="{BASE_MODEL_DIR}"' if saved else f'"{resolved}"'
    note = ("The base model is saved beside the adapters, in `base_model/`." if saved else
            f"The base model was the local folder `{shareable_path(str(resolved), output_dir)}` (relative to this run's "
            "folder): load it from where you have it.")  # fmt: skip
    code = (f"from peft import PeftModel\nfrom transformers import {auto}, AutoTokenizer\n\n"
            f"base = {auto}.from_pretrained({base_load})\n"
            f'model = PeftModel.from_pretrained(base, "{ref}")\n{tokenizer}')  # fmt: skip
    return f"{note}\n\n```python\n{code}\n```"


def _versions_text(summary) -> str:
    versions = summary.get("versions") or {}
    if not versions:
        return "Not recorded."
    return "\n".join(f"- {'Tunebook' if name == 'tunebook' else name} {v}" for name, v in versions.items())


# --------------------------------------------------------------------------------------------------------------
# Helpers


def _local_ref(model_dir: Path, output_dir: Path, config) -> str:
    """How a card's snippet names a model that is not on the Hub: the output_dir as the config gave it when that is
    relative (as the user would type it again), else the folder's name; merged/ below it."""
    given = str(config.get("output_dir") or "")
    base = given if given and given != "." and not given.startswith(("/", "~", "..")) else output_dir.name
    return (Path(base) / model_dir.relative_to(output_dir)).as_posix() if model_dir != output_dir else base


def _adapter_base(model_dir: Path) -> str:
    path = model_dir / "adapter_config.json"
    return (json.loads(path.read_text()).get("base_model_name_or_path") or "") if path.is_file() else ""


def _labels(model_dir: Path) -> list[str]:
    # A LoRA classifier's label set is in the config of its saved base (base_model/), a full model's in its own.
    path = next(
        (p for p in (model_dir / "config.json", model_dir / BASE_MODEL_DIR / "config.json") if p.is_file()), None
    )
    id2label = json.loads(path.read_text()).get("id2label") if path else None
    # transformers writes LABEL_0, LABEL_1 for causal LMs too: only named labels say something
    names = [str(v) for _, v in sorted((id2label or {}).items(), key=lambda kv: int(kv[0]))]
    return [] if all(n.startswith("LABEL_") for n in names) else names


def _hub_model(name: str | None) -> str | None:
    """The Hub name a model was loaded as: the name itself, or the one of a folder in the Hugging Face cache."""
    if not name or name.startswith(PACKAGE_PREFIX):  # pip:PACKAGE, a model a pip package installs
        return None
    if not looks_like_local_path(name):
        return name
    snapshot = hub_name_of_snapshot(name)
    return snapshot[0] if snapshot else None


def _hub_dataset(source: DataSource) -> str | None:
    if not source.is_local:
        return source.path
    snapshot = hub_name_of_snapshot(source.path)
    return snapshot[0] if snapshot else None


def _table(header: list[str], rows: list[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows])
