"""Typed, strict recipe configs: one dataclass per recipe, loaded from YAML and `--key value` overrides.

Precedence: dataclass defaults < `--config FILE.yaml` < command-line overrides. Every key is checked against
the dataclass: an unknown key names the closest valid one, and every value is coerced to the field's type or
rejected with the key and the value. Defaults live only in the dataclasses.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from .errors import ConfigError, install_excepthook, same_on_every_rank

__all__ = [
    "ALIASES",
    "Bounds",
    "TrainConfig",
    "check_bounds",
    "config_field",
    "new_default",
    "aliases_used",
    "config_to_dict",
    "load_config",
    "numeric_keys",
    "parse_config",
    "save_config",
    "saved_recipe",
]

C = TypeVar("C")


def config_field(text: str, default: Any = dataclasses.MISSING, *, bounds: str | None = None, **kwargs) -> Any:
    """A config key: its help text (`--help`, the docs), default (or `default_factory=`) and, for a number or a list
    of numbers, `bounds`: the values it takes, as an interval written as in mathematics ("[0, 1)", "(0, inf)";
    "(-inf, inf)": any number). Every numeric key declares them (a test checks), and non-finite values are never
    taken."""
    if default is dataclasses.MISSING and "default_factory" not in kwargs:
        raise TypeError("config fields need a default")
    metadata = {"help": text} if bounds is None else {"help": text, "bounds": Bounds.parse(bounds)}
    return field(default=default, metadata=metadata, **kwargs)


_INHERIT = "\0inherit"  # a help text that is not one: take the key's help from the class it overrides


def new_default(default: Any, text: str | None = None) -> Any:
    """A recipe's own default for a key its base config class defines; the help text stays the base's unless the
    key means something more specific here (`text`), and the bounds stay the base's."""
    return field(default=default, metadata={"help": _INHERIT if text is None else text, "new_default": True})


_INTERVAL = re.compile(r"^([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])])$")


@dataclass(frozen=True)
class Bounds:
    """The interval a numeric config key's values lie in (`config_field`'s `bounds`)."""

    low: float
    high: float
    low_closed: bool
    high_closed: bool

    @classmethod
    def parse(cls, text: str) -> Bounds:
        match = _INTERVAL.match(text.strip())
        if match is None:
            raise ValueError(f"bounds must be an interval such as '[0, 1)' or '(0, inf)', got {text!r}")
        left, low, high, right = match.groups()
        bounds = cls(float(low), float(high), left == "[", right == "]")
        if bounds.low > bounds.high or (bounds.low_closed and math.isinf(bounds.low)):
            raise ValueError(f"bounds {text!r} is not an interval of numbers")
        return bounds

    def __contains__(self, value: float) -> bool:
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return math.isfinite(value) and above and below

    def __str__(self) -> str:
        """As a message says it: 'in [0, 1)', '>= 1', 'a finite number'."""
        low, high = (int(x) if math.isfinite(x) and x == int(x) else x for x in (self.low, self.high))
        if math.isinf(self.low) and math.isinf(self.high):
            return "a finite number"
        if math.isinf(self.high):
            return f"{'>=' if self.low_closed else '>'} {low}"
        if math.isinf(self.low):
            return f"{'<=' if self.high_closed else '<'} {high}"
        return f"in {'[' if self.low_closed else '('}{low}, {high}{']' if self.high_closed else ')'}"


def numeric_keys(cls: type) -> list[str]:
    """The keys of config class `cls` that hold a number or a list of numbers (None allowed or not): the keys that
    must declare bounds."""
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if _numeric(hints[f.name]) is not None]


def _numeric(hint: Any) -> type | None:
    """int or float for a key holding one number or a list of them (or None), else None."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None
    if typing.get_origin(hint) is list:
        hint = typing.get_args(hint)[0] if typing.get_args(hint) else None
    return hint if hint in (int, float) else None


def check_bounds(key: str, value: Any, bounds: Bounds | None, source: str | None = None) -> None:
    """Raise a ConfigError naming the key, the bounds and the value (and where it was given) unless `value` (a
    number, a list of them, or None) lies within `bounds`."""
    if bounds is None or value is None:
        return
    where = f" (in {source})" if source else ""
    for position, number in enumerate(value if isinstance(value, list) else [value], 1):
        if isinstance(number, bool) or not isinstance(number, int | float) or number not in bounds:
            what = str(bounds)
            if not isinstance(number, int | float) or not math.isfinite(number):  # nan, inf, or not a number
                what = "a finite number" + ("" if what == "a finite number" else f" {what}")
            item = f" (item {position})" if isinstance(value, list) else ""
            raise ConfigError(f"config key '{key}' must be {what}, got {number!r}{item}{where}")


@dataclass
class TrainConfig:
    """Fields every recipe shares. Names follow transformers' `TrainingArguments` where the concept is the same."""

    def __init_subclass__(cls, **kwargs):
        # Runs before @dataclass turns the class body into fields: a `new_default(...)` gets the bounds of the key it
        # overrides, and its help text too unless it has one of its own.
        super().__init_subclass__(**kwargs)
        for name, value in list(vars(cls).items()):
            if isinstance(value, dataclasses.Field) and value.metadata.get("new_default"):
                base = next(
                    b.__dataclass_fields__[name]
                    for b in cls.__mro__[1:]
                    if name in getattr(b, "__dataclass_fields__", {})
                )
                text = value.metadata["help"]
                metadata = {**base.metadata, "help": base.metadata["help"] if text == _INHERIT else text}
                setattr(cls, name, field(default=value.default, metadata=metadata))

    # --- outputs
    output_dir: str = config_field("Where the model, checkpoints, metrics.jsonl and summary.json go.", "outputs/run")
    cache_dir: str | None = config_field(
        "Cache for tokenised data and generated assets (unset: $TUNEBOOK_CACHE or ~/.cache/tunebook).", None
    )
    push_to_hub: bool = config_field(
        "At the end, upload the final model directory (model, tokenizer, model card, config.yaml, summary.json, "
        "metrics.jsonl, report.png; never checkpoints or tracker files) to the Hub as hub_model_id. Needs network "
        "and a token with write access (HF_TOKEN or `hf auth login`), both checked at start-up.",
        False,
    )
    hub_model_id: str | None = config_field(
        "The Hub repository to push to, 'name' or 'org/name' (with push_to_hub).", None
    )
    hub_private_repo: bool | None = config_field(
        "Create the repository private (None: the Hub's default for the account); an existing one is left as is.",
        None,
    )
    # --- optimisation
    learning_rate: float = config_field("Peak AdamW learning rate.", 5e-5, bounds="[0, inf)")
    weight_decay: float = config_field(
        "AdamW weight decay (not applied to biases and norm weights).", 0.0, bounds="[0, inf)"
    )
    adam_beta1: float = config_field("AdamW beta1.", 0.9, bounds="[0, 1)")
    adam_beta2: float = config_field("AdamW beta2.", 0.999, bounds="[0, 1)")
    adam_epsilon: float = config_field("AdamW epsilon.", 1e-8, bounds="[0, inf)")
    max_grad_norm: float = config_field(
        "Clip the global gradient norm to this (0 disables clipping).", 1.0, bounds="[0, inf)"
    )
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = config_field(
        "Learning-rate schedule after warmup.", "linear"
    )
    warmup_ratio: float = config_field(
        "Fraction of the optimizer steps spent warming up linearly from 0.", 0.0, bounds="[0, 1)"
    )
    # --- batching and length of training
    per_device_train_batch_size: int = config_field("Micro-batch size per process.", 8, bounds="[1, inf)")
    per_device_eval_batch_size: int = config_field("Evaluation batch size per process.", 8, bounds="[1, inf)")
    gradient_accumulation_steps: int = config_field("Micro-batches per optimizer step.", 1, bounds="[1, inf)")
    num_train_epochs: float = config_field("Epochs to train when max_steps is -1.", 1.0, bounds="[0, inf)")
    max_steps: int = config_field(
        "Optimizer steps to train; -1 uses num_train_epochs, 0 only evaluates.", -1, bounds="[-1, inf)"
    )
    gradient_checkpointing: bool = config_field("Recompute activations in backward to save memory.", False)
    # --- speed
    torch_compile: bool | Literal["auto"] = config_field(
        "Compile each transformer block with torch.compile (regional compilation: one block's compile serves all). "
        "auto: only where it was measured to pay back: on CUDA, packed rows of one shape, at least 1,000 micro-batches "
        "(an H100: 1.27x eager's tokens/s after ~10 s of compiling), not under DeepSpeed, Liger or a 4-bit base; on a "
        "2-core CPU the first step takes ~15 s more for 6-10% per step (README).",
        "auto",
    )
    use_liger_kernel: bool = config_field(
        "Liger's Triton kernels for RMSNorm, RoPE and SwiGLU (pip install liger-kernel; CUDA only).", False
    )
    fused_cpu_layers: bool = config_field(
        "On a CPU, RMSNorm and rotary embeddings of models whose code is Llama's (Mistral, Qwen2/3, ...) run as fused "
        "autograd functions: the same math in fewer passes over memory (~5% of a step on the vs_peers model).",
        True,
    )
    # --- logging, evaluation, checkpoints
    logging_steps: int = config_field("Log train metrics every N optimizer steps.", 10, bounds="[1, inf)")
    eval_strategy: Literal["steps", "epoch"] = config_field(
        "When to evaluate during training: every eval_steps optimizer steps, or at the end of every epoch. There is "
        "always an evaluation at the end when there is eval data.",
        "steps",
    )
    eval_steps: int = config_field(
        "With eval_strategy steps: evaluate every N optimizer steps (0: only at the end).", 0, bounds="[0, inf)"
    )
    eval_on_start: bool = config_field("Also evaluate before the first step, to compare with the trained model.", True)
    metric_for_best_model: str | None = config_field(
        "Evaluation metric that picks the best checkpoint, e.g. eval_loss or eval_accuracy (the eval_ prefix may be "
        "left out). Default eval_loss when load_best_model_at_end or early_stopping_patience asks for one.",
        None,
    )
    greater_is_better: bool | None = config_field(
        "Whether a larger metric_for_best_model is better (None: false for losses and perplexity, else true).", None
    )
    load_best_model_at_end: bool = config_field(
        "Export the best checkpoint's weights as the final model instead of the last step's. Every evaluation that "
        "improves on the best saves a checkpoint, which checkpoint rotation keeps.",
        False,
    )
    early_stopping_patience: int = config_field(
        "Stop training after this many evaluations in a row without improving metric_for_best_model (0: never).",
        0,
        bounds="[0, inf)",
    )
    save_strategy: Literal["steps", "epoch", "no"] = config_field(
        "When to save resumable checkpoints: every save_steps optimizer steps, at the end of every epoch, or never "
        "(a stop signal still saves one).",
        "steps",
    )
    save_steps: int = config_field(
        "With save_strategy steps: save every N optimizer steps (0: no step checkpoints).", 0, bounds="[0, inf)"
    )
    save_total_limit: int = config_field(
        "Keep at most this many checkpoints, the newest (0: keep all).", 2, bounds="[0, inf)"
    )
    resume_from_checkpoint: str | None = config_field(
        "Continue a run exactly where it stopped: 'latest' (the newest complete checkpoint in output_dir; an error "
        "when there is none), 'auto' (the newest one, or a fresh start when there is none: for jobs that are "
        "requeued) or a checkpoint directory. Keys that would change what the run computes (data, batches, model, "
        "seed) must equal the checkpoint's; the learning-rate schedule and optimizer settings follow the new config.",
        None,
    )
    overwrite_output_dir: bool = config_field(
        "Start afresh in an output_dir that holds another run's checkpoints, deleting them (and its metrics, "
        "summary and tracker logs); without it such a run stops at start-up.",
        False,
    )
    nan_policy: Literal["stop", "skip"] = config_field(
        "On a non-finite loss or gradient norm: stop (exit non-zero, keeping the last good checkpoint) or skip "
        "that update and count it.",
        "stop",
    )
    peak_flops: float | None = config_field(
        "Peak FLOP/s of one device for the MFU figure (default: the data-sheet bf16 value of known GPUs; none on CPU).",
        None,
        bounds="(0, inf)",
    )
    report_to: str | list[str] = config_field(
        "Experiment trackers (through Accelerate): tensorboard, trackio, wandb, mlflow, a list of them, auto "
        "(tensorboard when installed) or none. They get the config and every metrics.jsonl record; local ones write "
        "under output_dir/runs.",
        "auto",
    )
    disable_tqdm: bool = config_field("Turn off progress bars.", False)
    # --- several processes and machines
    preflight_timeout: int = config_field(
        "Seconds all processes get to meet after data preparation; a node that never started, a crashed rank or "
        "ranks that disagree on config, data or versions then stop the run with one message instead of a hang.",
        300,
        bounds="[1, inf)",
    )
    ddp_timeout: int = config_field(
        "Timeout in seconds of the process group's collectives (torch.distributed); raise it if evaluation or a "
        "checkpoint save on one rank makes the others wait longer.",
        1800,
        bounds="[1, inf)",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = config_field("Log level of the main process.", "INFO")
    # numpy (data order, accelerate's set_seed) takes seeds from 0 to 2**32 - 1
    seed: int = config_field("Seed for model init, data order and dropout.", 42, bounds="[0, 4294967295]")
    # --- data loading
    dataloader_num_workers: int = config_field(
        "DataLoader worker processes that collate batches in the background (0: collate in the training loop).",
        2,
        bounds="[0, inf)",
    )
    dataloader_prefetch_factor: int = config_field("Batches each worker prepares ahead.", 2, bounds="[1, inf)")
    dataloader_pin_memory: bool = config_field("Pin host memory for faster copies when training on CUDA.", True)
    dataloader_non_blocking: bool = config_field(
        "Copy batches to the device asynchronously (with pinned memory), overlapping the copy with compute.", True
    )

    def __post_init__(self) -> None:
        """Computed defaults, resolved here so that config.yaml and `--help` show the values a run uses."""
        if self.cache_dir is None:
            from .locations import default_cache_dir

            self.cache_dir = str(default_cache_dir())

    def validate(self) -> None:
        """Reject impossible settings with the key and value at fault: each numeric key outside its bounds (declared
        with the field), then the rules that tie keys together."""
        for f in dataclasses.fields(self):
            check_bounds(f.name, getattr(self, f.name), f.metadata.get("bounds"))
        wants_best = self.load_best_model_at_end or self.early_stopping_patience
        if wants_best and self.eval_strategy == "steps" and self.eval_steps == 0:
            key = "load_best_model_at_end" if self.load_best_model_at_end else "early_stopping_patience"
            raise ConfigError(f"{key} needs evaluations during training: set eval_steps > 0 or eval_strategy: epoch")
        report_to_names(self.report_to)  # unknown trackers fail now; one not installed when the run starts
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            raise ConfigError(f"num_train_epochs must be > 0 when max_steps is -1, got {self.num_train_epochs}")
        if self.push_to_hub and not self.hub_model_id:
            raise ConfigError("push_to_hub needs hub_model_id, the repository to upload to ('name' or 'org/name')")
        if self.hub_model_id is not None and not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", self.hub_model_id):
            raise ConfigError(f"hub_model_id must be 'name' or 'org/name', got {self.hub_model_id!r}")

    def check_files(self) -> None:
        """Check that the local files this run will read exist, before it starts: what `load_config` (a command
        line) does after `validate`, and a config parsed for another purpose (a finished run's config.yaml, read by
        `tunebook export` after its data has moved) does not. Recipe configs with data override it."""


TRACKERS = ("tensorboard", "trackio", "wandb", "mlflow")  # each installs as the package of its name


def report_to_names(report_to: str | list[str]) -> list[str]:
    """The names in a `report_to` value (a name, a comma-separated string or a list), checked: each one a tracker of
    `TRACKERS`, `auto` or `none`, and `none` alone. Whether they are installed is `tunebook.run.trackers`' question."""
    names = report_to if isinstance(report_to, list) else str(report_to).split(",")
    names = [str(n).strip().lower() for n in names if str(n).strip()]
    for name in names:
        if name not in (*TRACKERS, "auto", "none"):
            raise ConfigError(
                f"report_to: unknown tracker {name!r}; choose from {', '.join(TRACKERS)}, auto or none (or a list)"
            )
    if "none" in names and len(names) > 1:
        raise ConfigError(f"report_to: 'none' cannot be combined with trackers, got {report_to!r}")
    return names


# --------------------------------------------------------------------------------------------------------------
# Loading


# Other tools' names for our keys (TRL, older transformers): accepted, resolved to ours, each use logged once.
ALIASES = {
    "max_length": "max_seq_length",
    "lora_modules_to_save": "modules_to_save",
    "torch_dtype": "dtype",
    "evaluation_strategy": "eval_strategy",
}


def load_config(cls: type[C], argv: list[str] | None = None) -> C:
    """Build `cls` from `--config FILE` and `--key value` / `--key=value` arguments (default: `sys.argv[1:]`), and
    check the local files it names (`check_files`).

    A boolean key may be given bare (`--packing`) or negated (`--no_packing`). Also installs the excepthook that
    prints Tunebook's user errors without a traceback, since this is the first thing a recipe's `__main__` block
    calls.
    """
    install_excepthook()
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(config_help(cls))
        raise SystemExit(0)
    try:
        config_file, overrides = _split_argv(argv, cls)
        config = parse_config(cls, config_file=config_file, overrides=overrides)
        config.check_files()
        return config
    except ConfigError as error:
        raise same_on_every_rank(error) from None


def parse_config(
    cls: type[C],
    config_file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    overrides_from: str = "command line",
) -> C:
    """Defaults < YAML file < overrides. Override values may be strings (from a command line) or Python values;
    `overrides_from` is how errors name where they came from."""
    values: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    if config_file is not None:
        data, lines = _read_yaml(Path(config_file))
        for key, value in data.items():
            where = f"{config_file}, line {lines[key]}"
            name = _resolve_alias(cls, key, aliases, where)
            if name in values:
                raise ConfigError(f"config key '{name}' is given twice in {config_file}: as '{name}' and as its alias")
            values[name] = _coerce_field(cls, name, value, where)
    given_here: set[str] = set()
    for key, value in (overrides or {}).items():
        name = _resolve_alias(cls, key, aliases, overrides_from)
        if name in given_here:
            raise ConfigError(f"config key '{name}' is given twice in the {overrides_from} (once by an alias)")
        given_here.add(name)
        values[name] = _coerce_field(cls, name, value, overrides_from)
    config = cls(**values)
    config.validate()
    object.__setattr__(config, "_aliases_used", aliases)  # not a field: for the start-up log only
    return config


def _resolve_alias(cls: type, key: str, used: dict[str, str], where: str) -> str:
    names = {f.name for f in dataclasses.fields(cls)}
    target = ALIASES.get(key)
    if key in names or target is None or target not in names:
        return key
    used[key] = target
    return target


def aliases_used(config: Any) -> dict[str, str]:
    """{alias: key} for every other tool's name (`ALIASES`) this config was given with."""
    return dict(getattr(config, "_aliases_used", {}))


def _bool_fields(cls: type) -> set[str]:
    hints = typing.get_type_hints(cls)
    # bool, bool | None, bool | Literal["auto"]: a bare --key is true, --no_key false
    return {f.name for f in dataclasses.fields(cls) if hints[f.name] is bool or bool in typing.get_args(hints[f.name])}


def _split_argv(argv: list[str], cls: type | None = None) -> tuple[str | None, dict[str, str]]:
    booleans = _bool_fields(cls) if cls is not None else set()
    booleans |= {alias for alias, key in ALIASES.items() if key in booleans}
    config_file = None
    overrides: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: use --config FILE.yaml and --key value")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        following = argv[i + 1] if i + 1 < len(argv) else None
        if eq:
            pass
        elif key.startswith("no_") and key[3:] in booleans:  # --no_packing
            key, value = key[3:], "false"
        elif following is None or following.startswith("--"):
            if key in booleans:  # a bare flag: --packing
                overrides[key] = "true"
                i += 1
                continue
            raise ConfigError(f"--{key} needs a value (--{key} VALUE or --{key}=VALUE)")
        else:
            value = following
            i += 1
        if key == "config":
            config_file = value
        else:
            overrides[key] = value
        i += 1
    return config_file, overrides


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The file's mapping and the line of each top-level key, so errors can point at the line."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of keys to values, got {type(data).__name__}")
    lines = {key.value: key.start_mark.line + 1 for key, _ in root.value if isinstance(key, yaml.ScalarNode)}
    return data, lines


# --------------------------------------------------------------------------------------------------------------
# Type coercion


def _coerce_field(cls: type, key: str, value: Any, source: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if key not in fields:
        close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown config key '{key}' (in {source}){hint}")
    hint = typing.get_type_hints(cls)[key]
    try:
        value = _coerce(hint, value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config key '{key}' (in {source}): {e}") from None
    check_bounds(key, value, fields[key].metadata.get("bounds"), source)  # here, where the message can say where
    return value


_NULLS = {"null", "none", "~", ""}
_TRUE = {"true", "yes", "1", "on"}
_FALSE = {"false", "no", "0", "off"}


_EXPONENT_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _yaml_floats(value: Any) -> Any:
    """Numbers like 1e-5 inside lists and dicts (a model_config's rms_norm_eps, say) as floats.

    YAML 1.1, which PyYAML implements, reads a float only with a dot (1.0e-5), so `1e-5` and even JSON's `1e-05`
    arrive as strings; top-level fields are converted by their type, nested values need this.
    """
    if isinstance(value, dict):
        return {k: _yaml_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_yaml_floats(v) for v in value]
    if isinstance(value, str) and _EXPONENT_FLOAT.match(value.strip()):
        return float(value)
    return value


def _choices(hint: Any) -> list[str | None]:
    """The values a bool or Literal type takes, as a message names them ([None] for any other type)."""
    if hint is bool:
        return ["true", "false"]
    if typing.get_origin(hint) is Literal:
        return [repr(a) for a in typing.get_args(hint)]
    return [None]


def _coerce(hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.strip().lower() in _NULLS and type(None) in args):
            if type(None) in args:
                return None
        if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):  # --train_data '[a.jsonl, b.jsonl]'
            args = sorted(args, key=lambda a: (typing.get_origin(a) or a) not in (list, dict))
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        choices = [c for a in args if a is not type(None) for c in _choices(a)]
        if None not in choices:  # only bools and literals: name them all in one phrase
            raise ValueError(f"expected {', '.join(choices[:-1])} or {choices[-1]}, got {value!r}")
        raise ValueError(" or ".join(dict.fromkeys(errors)))
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool):
            raise ValueError(f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ValueError(f"expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ValueError(f"expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"expected a string, got {value!r}")
    if origin in (list, dict) or hint in (list, dict):
        target = origin or hint
        if isinstance(value, str):  # from a command line: parse as YAML, e.g. --train_data '[a.jsonl, b.jsonl]'
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                raise ValueError(f"expected a {target.__name__} in YAML syntax, got {value!r}") from None
        if not isinstance(value, target):
            raise ValueError(f"expected a {target.__name__}, got {value!r}")
        return _yaml_floats(value)
    raise TypeError(f"unsupported config field type {hint!r}")


# --------------------------------------------------------------------------------------------------------------
# Output


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


RECIPE_LINE = "# tunebook recipe: "


def save_config(config: Any, path: str | Path, recipe: str | None = None) -> None:
    """Write the resolved config as YAML, loadable again with `--config`; the recipe, when given, is named in a
    first comment line (a key would not load back into the config class)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    header = f"{RECIPE_LINE}{recipe}\n" if recipe else ""
    tmp.write_text(header + yaml.safe_dump(config_to_dict(config), sort_keys=False))
    tmp.replace(path)


def saved_recipe(path: str | Path) -> str | None:
    """The recipe named in a `config.yaml` written by `save_config`, or None."""
    first = Path(path).read_text().split("\n", 1)[0]
    return first[len(RECIPE_LINE) :].strip() or None if first.startswith(RECIPE_LINE) else None


def config_help(cls: type) -> str:
    hints = typing.get_type_hints(cls)
    lines = [f"{cls.__name__} keys (use --config FILE.yaml and/or --key value):"]
    defaults = cls()  # computed defaults (cache_dir, the tiny model...) resolved, as a run would use them
    for f in dataclasses.fields(cls):
        default = getattr(defaults, f.name)
        bounds = f", {f.metadata['bounds']}" if "bounds" in f.metadata else ""  # ", in [0, 1)", ", >= 1"
        lines.append(
            f"  --{f.name} ({_type_name(hints[f.name])}{bounds}, default {default!r})\n"
            f"      {f.metadata.get('help', '')}"
        )
    return "\n".join(lines)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "|".join(map(str, typing.get_args(hint)))
    if typing.get_origin(hint) in (Union, types.UnionType):  # bool | Literal["auto"] reads bool | auto
        return " | ".join("None" if a is type(None) else _type_name(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is not None:  # list[str]
        return str(hint).replace("typing.", "")
    return getattr(hint, "__name__", str(hint).replace("typing.", ""))
