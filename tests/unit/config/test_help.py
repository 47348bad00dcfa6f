"""`--help` of every recipe: its keys under the section headers, in the sections' order, each key once with its
default, the keys most runs set first; a key declared without a section is listed under advanced, never left out."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tunebook.config import config_field, config_help, parse_config
from tunebook.config.fields import SECTIONS
from tunebook.recipe import RECIPES, recipe_config_class

HEADERS = [f"{header}:" for header in SECTIONS.values()]
KEY_LINE = re.compile(r"^  --(\w+) \((.*), default (.*)\)$")


def _sections(text: str) -> dict[str, list[tuple[str, str]]]:
    """{header: [(key, shown default), ...]} in the order the help prints them."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        if line in HEADERS:
            assert line not in sections, f"{line} twice"
            current = sections.setdefault(line, [])
        elif match := KEY_LINE.match(line):
            assert current is not None, f"{line} before any section header"
            current.append((match.group(1), match.group(3)))
    return sections


@pytest.mark.parametrize("name", RECIPES)
def test_every_key_is_listed_once_under_a_section_in_order_with_its_default(name):
    cls = recipe_config_class(name)
    sections = _sections(config_help(cls))
    assert list(sections) == [h for h in HEADERS if h in sections]  # the sections' order
    assert list(sections)[:4] == ["Model:", "Data:", "LoRA:", "Training:"]  # what a newcomer looks for first
    listed = [key for entries in sections.values() for key, _ in entries]
    fields = [f.name for f in dataclasses.fields(cls)]
    assert sorted(listed) == sorted(fields)  # every key, and each once
    defaults = parse_config(cls)
    for entries in sections.values():
        for key, shown in entries:
            assert shown == repr(getattr(defaults, key)), key


def test_the_keys_most_runs_set_open_their_sections():
    from tunebook.config import SFTConfig

    sections = _sections(config_help(SFTConfig))
    first = {header: entries[0][0] for header, entries in sections.items()}
    assert first["Model:"] == "model_name_or_path" and first["Data:"] == "train_data"
    assert first["LoRA:"] == "use_peft" and first["Training:"] == "learning_rate"
    assert first["Outputs, logging and checkpoints:"] == "output_dir" and first["Hugging Face Hub:"] == "push_to_hub"
    training = [key for key, _ in sections["Training:"]]
    assert training.index("max_steps") < training.index("adam_beta1")  # optimizer details after the common keys
    data = [key for key, _ in sections["Data:"]]
    assert data[:5] == ["train_data", "eval_data", "max_seq_length", "data_format", "packing"]  # the common keys
    assert data.index("group_by_length") < data.index("eval_split_ratio")  # then the recipe's own, then the rest


def test_a_recipes_own_keys_come_before_the_shared_ones_of_their_section():
    from tunebook.config import GRPOConfig

    training = [key for key, _ in _sections(config_help(GRPOConfig))["Training:"]]
    assert training.index("reward_functions") < training.index("loss_type") < training.index("adam_beta1")


def test_a_key_declared_without_a_section_is_listed_under_advanced():
    """What a key added later gets with no extra work: it is in the help, under advanced."""

    @dataclasses.dataclass
    class Config:
        learning_rate: float = config_field("Peak learning rate.", 1e-3, bounds="(0, inf)", section="training")
        log_every_seconds: float = config_field("A key someone adds later.", 30.0, bounds="(0, inf)")
        plain: int = dataclasses.field(default=3)  # not even a config_field

    sections = _sections(config_help(Config))
    assert sections == {
        "Training:": [("learning_rate", "0.001")],
        "Advanced (speed, processes, data loading):": [("log_every_seconds", "30.0"), ("plain", "3")],
    }


def test_a_section_must_be_one_of_the_sections():
    with pytest.raises(ValueError, match="section must be one of model, data, lora"):
        config_field("x", 1, section="optimizer")
