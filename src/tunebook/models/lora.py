"""LoRA through peft: adapters on a model, adapter-only checkpoints, the adapter directory and its merged model.

A LoRA run trains and saves only the adapters (and `modules_to_save`, such as a new classification head). Its
checkpoints hold them and the trainer state, not the frozen base weights; its output is a peft adapter directory
that `load_adapter_model` loads (it finds the base through `base_model_name_or_path`), and with `merge_adapter`
also a plain merged model directory. A base model built from a config (the tiny defaults) has no path to point to,
so its weights are saved once, as `output_dir/base_model/`.

The adapter records its base as a Hub name (with the commit, for a folder of the Hugging Face cache) or, for a local
folder, as a path relative to the adapter directory (`./base_model`, `../models/my-base`): the run's folder moves and
still loads, together with the base it names. `load_adapter_model` resolves such a path against the adapter
directory; `peft.AutoPeftModelForCausalLM.from_pretrained` resolves it against the current directory, so it loads an
adapter with a Hub base from anywhere, and one with a local base from inside the adapter directory.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path

import torch

from .. import compat
from ..errors import ConfigError
from ..locations import hub_name_of_snapshot, looks_like_local_path
from .quiet import deepspeed_cpu_notice_filtered
from .tokenizer import save_tokenizer
from .wrappers import unwrap

__all__ = [
    "apply_lora",
    "describe_parameters",
    "is_peft_model",
    "merge_adapter_dir",
    "parameter_counts",
    "register_adapter_checkpoints",
    "adapter_base",
    "adapter_writer",
    "load_adapter_model",
    "save_checkpoint_adapter",
]

ADAPTER_DIR = "adapter"  # inside a checkpoint
BASE_MODEL_DIR = "base_model"  # inside output_dir, for a base built from a config
TASK_TYPES = {"causal_lm": "CAUSAL_LM", "classification": "SEQ_CLS"}


def apply_lora(
    model: torch.nn.Module, config, task: str = "causal_lm", target_modules: str | list[str] | None = None
) -> torch.nn.Module:
    """`model` with LoRA adapters from the config's `lora_*` keys (`use_peft`); only they (and
    `modules_to_save`) are trainable. A 4-bit model (`load_in_4bit`) is first prepared for k-bit training.
    `target_modules`, where given, replaces `lora_target_modules` as peft takes it (a string is a regex over whole
    module names). A vision-language model's `all-linear` is its language model's linear layers, and the
    projector's unless `freeze_projector` (`tunebook.models.vision.lora_targets`): peft's would adapt the tower too."""
    try:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    except ImportError:
        raise ConfigError("use_peft needs peft: pip install 'tunebook[peft]'") from None
    if getattr(model, "is_loaded_in_4bit", False):
        # Non-reentrant checkpointing is set up by build_*; peft must not switch it back to reentrant.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if target_modules is None:
        from .vision import is_vision_language_model, lora_targets

        targets = config.lora_target_modules
        target_modules = targets if targets == "all-linear" or isinstance(targets, list) else [targets]
        if targets == "all-linear" and is_vision_language_model(model.config):
            target_modules = lora_targets(model, projector=not getattr(config, "freeze_projector", False))
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=target_modules,
        modules_to_save=config.modules_to_save,
        task_type=TASK_TYPES[task],
        trainable_token_indices=None if config.modules_to_save else _new_token_rows(model),
    )
    try:
        # peft (0.21) asks the model `is_gradient_checkpointing`, which transformers 5 deprecates with a FutureWarning
        # at every LoRA start; the answer is the same (`is_activation_checkpointing`), and the call is peft's.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r"`is_gradient_checkpointing` is deprecated", FutureWarning)
            return get_peft_model(model, lora)
    except ValueError as error:  # e.g. target modules not found in the model
        raise ConfigError(f"lora_target_modules: {str(error).splitlines()[0]}") from None


def _new_token_rows(model: torch.nn.Module) -> dict[str, list[int]] | None:
    """Tokens the tokenizer added (ChatML markers for a base model): their embedding and output rows train too.
    Frozen at their mean-embedding start, `<|im_end|>` could hardly be predicted, and the model would not stop."""
    rows = getattr(model, "new_token_rows", None)
    if not rows:
        return None
    names = {id(module): name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
    layers = [model.get_input_embeddings(), model.get_output_embeddings()]
    if layers[1] is not None and layers[1].weight is layers[0].weight:  # tied: peft updates both through one
        layers = layers[:1]
    return {names[id(layer)]: list(rows) for layer in layers if layer is not None and id(layer) in names}


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Trainable and total parameters (each shared tensor once; a DeepSpeed ZeRO-3 partitioned one at its full
    size, `ds_numel`, not the empty tensor each process holds in its place)."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    return {
        "trainable_parameters": sum(n for n, trainable in sizes if trainable),
        "total_parameters": sum(n for n, _ in sizes),
    }


def describe_parameters(model: torch.nn.Module) -> str:
    """'1.09M parameters' or, with frozen weights, '1.09M parameters, 0.05M trainable (4.6%)'."""
    counts = parameter_counts(model)
    total, trainable = counts["total_parameters"], counts["trainable_parameters"]
    text = f"{total / 1e6:.2f}M parameters"
    return text if trainable == total else f"{text}, {trainable / 1e6:.3f}M trainable ({100 * trainable / total:.2f}%)"


def register_adapter_checkpoints(accelerator, run_dir: str | Path) -> None:
    """Make `save_state`/`load_state` keep only a peft model's adapters, in `<checkpoint>/adapter/`.

    Accelerate would save the whole state dict, base weights included; its pre-hooks take the peft model out of
    what it saves and loads (as diffusers' LoRA scripts do), and the adapters go through peft instead. The
    adapter's config points at the base model (saved once into `run_dir/base_model/` if it was built from a
    config), so `tunebook export --merge` can rebuild the model from a checkpoint. Other models save as before.
    """
    from safetensors.torch import load_file

    def save_hook(models: list, weights: list, output_dir: str) -> None:
        for i in reversed(range(len(models))):
            model = unwrap(models[i])
            if is_peft_model(model):
                save_checkpoint_adapter(accelerator, model, Path(output_dir) / ADAPTER_DIR, Path(run_dir))
                if i < len(weights):  # under FSDP Accelerate saves the (sharded) model itself and passes no weights
                    weights.pop(i)

    def load_hook(models: list, input_dir: str) -> None:
        from peft import set_peft_model_state_dict

        for i in reversed(range(len(models))):
            model = unwrap(models[i])
            if is_peft_model(model):
                path = Path(input_dir) / ADAPTER_DIR / "adapter_model.safetensors"
                if not path.is_file():
                    raise ConfigError(f"{input_dir} holds no adapter weights ({path}): not a checkpoint of a LoRA run")
                result = set_peft_model_state_dict(model, load_file(path, device=str(accelerator.device)))
                if getattr(result, "unexpected_keys", None):
                    raise ConfigError(f"{path}: adapter weights do not fit the model: {result.unexpected_keys[:3]}")
                models.pop(i)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def adapter_writer(accelerator, model, tokenizer, output_dir: str | Path, merge: bool = False):
    """The final save of a LoRA model (`tunebook.training.checkpoint.save_adapter`), as (write, bytes it writes):
    gathers the adapter weights (sharded states, on every process) and returns `write()`, which writes the adapter
    directory (adapters, `adapter_config.json`, tokenizer) into `output_dir` and, with `merge`, the merged model
    into `output_dir/merged` (on the main process)."""
    output_dir = Path(output_dir)
    state_dict = accelerator.get_state_dict(model)
    peft_model = unwrap(model)
    if _is_sharded(peft_model):  # the base copy, where one is needed, from weights every process gathers
        _copy_sharded_base(peft_model, output_dir, accelerator)

    def write() -> None:
        _point_at_base(peft_model, _base_model_path(peft_model, output_dir))
        peft_model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        _record_base_relative(output_dir)
        save_tokenizer(tokenizer, output_dir)
        if merge:
            merge_adapter_dir(output_dir, output_dir / "merged")

    return write, sum(t.numel() * t.element_size() for t in state_dict.values())


def save_checkpoint_adapter(accelerator, peft_model, adapter_dir: Path, run_dir: Path) -> None:
    """A checkpoint's adapter directory (call on every process). Its config points at the base model, copied once
    into `run_dir/base_model/` if it has no path of its own. Under FSDP2 the weights are shards (DTensors) and
    peft's `save_pretrained` would write the main process's shards only: every process gathers them first."""
    adapters = None
    if _is_sharded(peft_model):
        from peft import get_peft_model_state_dict

        state = peft_model.state_dict()
        kept = {id(v) for v in get_peft_model_state_dict(peft_model, state_dict=state).values()}
        adapters = {k: _full(v) for k, v in state.items() if id(v) in kept}  # full names, as save_pretrained filters
        _copy_sharded_base(peft_model, run_dir, accelerator)
    if accelerator.is_main_process:
        _point_at_base(peft_model, _base_model_path(peft_model, run_dir))
        peft_model.save_pretrained(adapter_dir, state_dict=adapters, safe_serialization=True)
        _record_base_relative(adapter_dir)


def _dtensor_type() -> type | None:
    """torch's DTensor class, or None in a build without it (`compat.dtensor_type`)."""
    return compat.dtensor_type()


def _is_sharded(module: torch.nn.Module) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in module.parameters())


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole on the CPU (a collective: every process calls it, in the same order)."""
    dtensor = _dtensor_type()
    return tensor.full_tensor().cpu() if dtensor and isinstance(tensor, dtensor) else tensor.detach().cpu()


def _copy_sharded_base(peft_model, run_dir: Path, accelerator) -> None:
    """`_base_model_path`'s copy of the base (where it needs one) for a sharded peft model, made on every process
    from the gathered weights under the base model's own names, as `unload()` leaves them unsharded: LoRA layers
    back to their base layer, `modules_to_save` to its trained copy. Written by the main process."""
    base_dir = run_dir / BASE_MODEL_DIR
    if _own_base_path(peft_model) or (base_dir / "config.json").is_file():
        return
    copy_of = f".modules_to_save.{peft_model.active_adapter}."
    base = {}
    for key, value in peft_model.state_dict().items():
        if "lora_" in key or ".original_module." in key or (".modules_to_save." in key and copy_of not in key):
            continue
        plain = key.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(copy_of, ".")
        base[plain] = _full(value)
    if accelerator.is_main_process:
        peft_model.get_base_model().save_pretrained(base_dir, state_dict=base, safe_serialization=True)


def _point_at_base(peft_model, base: tuple[str, str | None]) -> None:
    # The whole path while peft saves: it reads the base's config to tell whether the vocabulary grew (and then saves
    # the embeddings), from the current directory. `_record_base_relative` then makes it relative.
    for peft_config in peft_model.peft_config.values():
        peft_config.base_model_name_or_path, revision = base
        if revision:  # the exact weights trained on, not whatever the name resolves to later
            peft_config.revision = revision


def _own_base_path(peft_model) -> str:
    """The path or Hub name the base loads from, or "" where the adapter needs a copy of the base: a base built from
    a config, and a classifier's base (with our label set and head size)."""
    name = getattr(peft_model.get_base_model(), "name_or_path", "") or ""
    task = next(iter(peft_model.peft_config.values())).task_type
    return name if task != "SEQ_CLS" else ""


def _base_model_path(peft_model, output_dir: Path) -> tuple[str, str | None]:
    """Where the adapter's base model loads from: the path or Hub name it was loaded from, or a copy of its weights
    saved in `output_dir/base_model/` now. The copy is made for a base built from a config, which has no path, and
    for classifiers, whose base has our label set and head size (loading the original would give another).

    A base loaded from a folder of the Hugging Face cache (`.../models--org--name/snapshots/<commit>/`) is recorded
    by its Hub name and commit: that loads on any machine (and on the Hub's pages), the cache path only on this one.
    Returns (path or name, revision or None)."""
    name = _own_base_path(peft_model)
    if name:
        path = Path(name).expanduser()
        if not path.exists():
            return name, None  # a Hub name
        snapshot = hub_name_of_snapshot(path)
        return snapshot if snapshot else (str(path.resolve()), None)
    base_dir = output_dir / BASE_MODEL_DIR
    if not (base_dir / "config.json").is_file():
        # unload() strips the adapters from a copy, leaving the frozen base weights (built once, never trained).
        base = copy.deepcopy(peft_model).unload()
        base.save_pretrained(base_dir, safe_serialization=True)
    return str(base_dir.resolve()), None


def _record_base_relative(adapter_dir: Path) -> None:
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = recorded_base(config.get("base_model_name_or_path") or "", adapter_dir)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def recorded_base(base: str, adapter_dir: str | Path) -> str:
    """How `adapter_dir`'s config names its base: a local folder by its path relative to the adapter directory
    (`./base_model`, `../models/my-base`; the two move together), a Hub name as it is."""
    path = Path(base).expanduser()
    if not looks_like_local_path(base) or not path.is_dir():
        return base
    relative = Path(os.path.relpath(path.resolve(), Path(adapter_dir).resolve())).as_posix()
    return relative if relative.startswith("../") else f"./{relative}"


def adapter_base(adapter_dir: str | Path) -> tuple[str, str | None]:
    """(path or Hub name, revision) of the base model `adapter_dir`'s config names: a relative path resolved against
    the adapter directory (`recorded_base`), an absolute one (adapters of earlier versions) or a Hub name as it is."""
    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path") or ""
    if base.startswith(("./", "../")):
        base = str((adapter_dir / base).resolve())
    return base, config.get("revision")


def load_adapter_model(adapter_dir: str | Path, trust_remote_code: bool = False, **kwargs):
    """The peft model of an adapter directory, on its base model (`adapter_base`): a causal LM, or a sequence
    classifier for a classifier's adapters. `kwargs` go to the base's `from_pretrained` (`dtype="auto"` unless
    given). `trust_remote_code`: the base model may run its own Python code."""
    peft = _peft()
    from transformers import AutoModelForSequenceClassification

    from .vision import generative_auto_class

    adapter_dir = Path(adapter_dir)
    task = json.loads((adapter_dir / "adapter_config.json").read_text()).get("task_type")
    base, revision = adapter_base(adapter_dir)
    # A CAUSAL_LM adapter of a vision-language model: its base loads whole, vision tower included
    auto_class = (
        AutoModelForSequenceClassification
        if task == "SEQ_CLS"
        else generative_auto_class(base, trust_remote_code, revision)
    )
    kwargs = {"dtype": "auto", **({"revision": revision} if revision else {}), **kwargs}
    model = auto_class.from_pretrained(base, trust_remote_code=trust_remote_code, **kwargs)
    return peft.PeftModel.from_pretrained(model, adapter_dir)


def _peft():
    """peft, or one line saying how to install it."""
    try:
        import peft
    except ImportError:
        raise ConfigError("LoRA adapters need peft: pip install 'tunebook[peft]'") from None
    return peft


def merge_adapter_dir(adapter_dir: str | Path, out_dir: str | Path, trust_remote_code: bool = False) -> Path:
    """Load an adapter directory with its base model, fold the adapters into the weights and save a plain model
    directory (with the tokenizer, when the adapter directory has one). `trust_remote_code`: the base model may
    run its own Python code."""
    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    merged = load_adapter_model(adapter_dir, trust_remote_code).merge_and_unload()
    with deepspeed_cpu_notice_filtered():  # save_pretrained imports DeepSpeed, where installed
        merged.save_pretrained(out_dir, safe_serialization=True)
    if (adapter_dir / "tokenizer_config.json").is_file():  # a vision-language model's processor, or a tokenizer
        from .vision import load_saved_processor_or_tokenizer

        save_tokenizer(load_saved_processor_or_tokenizer(adapter_dir, trust_remote_code), out_dir)
    return out_dir
