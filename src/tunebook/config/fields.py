"""How a config key is declared: `config_field` (help text, default, bounds, the section of `--help` it is listed in),
`new_default` (a recipe's own default for a key its base class defines) and `Bounds`, the interval a numeric key's
values lie in, with `check_bounds`."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from ..errors import ConfigError

__all__ = [
    "SECTIONS",
    "Bounds",
    "check_bounds",
    "config_field",
    "inherit_new_defaults",
    "new_default",
    "numeric_keys",
    "section_of",
]

# The sections of `--help`, in the order it lists them (a newcomer's order: what to train, on what, how), with their
# headers. A key declared without one is listed under advanced: never left out.
SECTIONS = {
    "model": "Model",
    "data": "Data",
    "lora": "LoRA",
    "training": "Training",
    "generation": "Generation engine (GRPO: transformers or vLLM, async)",
    "evaluation": "Evaluation",
    "vision": "Images (vision-language models)",
    "outputs": "Outputs, logging and checkpoints",
    "hub": "Hugging Face Hub",
    "advanced": "Advanced (speed, processes, data loading)",
}


def config_field(
    text: str,
    default: Any = dataclasses.MISSING,
    *,
    bounds: str | None = None,
    section: str = "advanced",
    common: bool = False,
    **kwargs,
) -> Any:
    """A config key: its help text (`--help`, the docs), default (or `default_factory=`) and, for a number or a list
    of numbers, `bounds`: the values it takes, as an interval written as in mathematics ("[0, 1)", "(0, inf)";
    "(-inf, inf)": any number). Every numeric key declares them (a test checks), and non-finite values are never
    taken. `section` is where `--help` lists it (one of `SECTIONS`); `common` keys, the ones most runs set, open
    their section."""
    if default is dataclasses.MISSING and "default_factory" not in kwargs:
        raise TypeError("config fields need a default")
    if section not in SECTIONS:
        raise ValueError(f"section must be one of {', '.join(SECTIONS)}, got {section!r}")
    metadata = {"help": text, "section": section, "common": common}
    if bounds is not None:
        metadata["bounds"] = Bounds.parse(bounds)
    return field(default=default, metadata=metadata, **kwargs)


def section_of(f: dataclasses.Field) -> tuple[str, bool]:
    """(section, common) of config field `f`: where `--help` lists it ("advanced" for a field made without
    `config_field`)."""
    return f.metadata.get("section", "advanced"), bool(f.metadata.get("common", False))


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
    """int or float for a key holding one number or a list of them (or None, or a word such as "auto"), else
    None."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None) and typing.get_origin(a) is not Literal]
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
        if isinstance(number, str):  # a word the key's type allows besides numbers ("auto")
            continue
        if isinstance(number, bool) or not isinstance(number, int | float) or number not in bounds:
            what = str(bounds)
            if not isinstance(number, int | float) or not math.isfinite(number):  # nan, inf, or not a number
                what = "a finite number" + ("" if what == "a finite number" else f" {what}")
            item = f" (item {position})" if isinstance(value, list) else ""
            raise ConfigError(f"config key '{key}' must be {what}, got {number!r}{item}{where}")


def inherit_new_defaults(cls: type) -> None:
    """Give each `new_default(...)` in the body of config class `cls` the bounds of the key it overrides, and its help
    text too unless it has one of its own. Called from `TrainConfig.__init_subclass__`, before @dataclass turns the
    class body into fields."""
    for name, value in list(vars(cls).items()):
        if isinstance(value, dataclasses.Field) and value.metadata.get("new_default"):
            base = next(
                b.__dataclass_fields__[name] for b in cls.__mro__[1:] if name in getattr(b, "__dataclass_fields__", {})
            )
            text = value.metadata["help"]
            metadata = {**base.metadata, "help": base.metadata["help"] if text == _INHERIT else text}
            setattr(cls, name, field(default=value.default, metadata=metadata))
