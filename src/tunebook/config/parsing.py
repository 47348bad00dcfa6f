"""Loading a config: dataclass defaults < `--config FILE.yaml` < `--key value` overrides, and the way back
(`save_config`, `--help`).

Every key is checked against the dataclass: an unknown key names the closest valid one (and the file and line it
came from), and every value is coerced to the field's type or rejected with the key and the value. Defaults live
only in the dataclasses; the rules that tie keys together are each class's `validate` (`tunebook.config.checks`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from ..errors import ConfigError, enter_command_line, same_on_every_rank
from .fields import SECTIONS, check_bounds, section_of

__all__ = [
    "ALIASES",
    "aliases_used",
    "config_help",
    "config_to_dict",
    "load_config",
    "parse_config",
    "save_config",
    "saved_recipe",
]

C = TypeVar("C")


# --------------------------------------------------------------------------------------------------------------
# Loading


# Other tools' names for our keys (TRL, older transformers): accepted, resolved to ours, each use logged once.
ALIASES = {
    "max_length": "max_seq_length",
    "lora_modules_to_save": "modules_to_save",
    "torch_dtype": "dtype",
    "evaluation_strategy": "eval_strategy",
    "vllm_importance_sampling_cap": "vllm_importance_sampling_clip_max",  # TRL < 1.6
}


def load_config(cls: type[C], argv: list[str] | None = None, check_files: bool = True) -> C:
    """Build `cls` from `--config FILE` and `--key value` / `--key=value` arguments (default: `sys.argv[1:]`), and
    check the local files it names and what this machine must have for it (`check_files`; not for a plan of a run
    on another machine).

    A boolean key may be given bare (`--packing`) or negated (`--no_packing`). Reading `sys.argv` (no `argv`), this is
    a recipe's `__main__` block, its process's entry point: `enter_command_line` (one-line errors, the root logger).
    """
    if argv is None:
        enter_command_line()
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(config_help(cls))
        raise SystemExit(0)
    try:
        config_file, overrides = _split_argv(argv, cls)
        config = parse_config(cls, config_file=config_file, overrides=overrides)
        if check_files:
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
    """Every key of config class `cls` with its type, bounds, default and help, grouped under the headers of
    `SECTIONS` in their order. Within a section: the keys most runs set (`common`), then the recipe's own (those no
    base class declares: GRPO's loss before AdamW's betas), then the rest, each group in the order of declaration."""
    hints = typing.get_type_hints(cls)
    defaults = cls()  # computed defaults (cache_dir, the tiny model...) resolved, as a run would use them
    inherited = {name for base in cls.__mro__[1:] for name in getattr(base, "__dataclass_fields__", {})}
    grouped: dict[str, list] = {name: [] for name in SECTIONS}
    for f in dataclasses.fields(cls):
        section, common = section_of(f)
        grouped[section].append(((not common, not common and f.name in inherited), f))
    lines = [f"{cls.__name__} keys: --config FILE.yaml and/or --key value (the keys most runs set open each section)"]
    for name, entries in grouped.items():
        if not entries:
            continue
        lines.append(f"\n{SECTIONS[name]}:")
        for _, f in sorted(entries, key=lambda entry: entry[0]):  # stable: declaration order within each group
            bounds = f", {f.metadata['bounds']}" if "bounds" in f.metadata else ""  # ", in [0, 1)", ", >= 1"
            lines.append(f"  --{f.name} ({_type_name(hints[f.name])}{bounds}, default {getattr(defaults, f.name)!r})")
            help_text = f.metadata.get("help", "")
            lines.extend(textwrap.wrap(help_text, 118, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "|".join(map(str, typing.get_args(hint)))
    if typing.get_origin(hint) in (Union, types.UnionType):  # bool | Literal["auto"] reads bool | auto
        return " | ".join("None" if a is type(None) else _type_name(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is not None:  # list[str]
        return str(hint).replace("typing.", "")
    return getattr(hint, "__name__", str(hint).replace("typing.", ""))
