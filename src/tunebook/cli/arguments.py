"""Options the `tunebook` subcommands take out of their arguments before the rest goes to the config parser."""

from __future__ import annotations

import argparse

__all__ = ["pop_option", "whole_number"]


def pop_option(argv: list[str], name: str, default: str) -> tuple[str, list[str]]:
    """`--name value` or `--name=value` taken out of argv (the rest goes to the config parser)."""
    rest, value, i = [], default, 0
    while i < len(argv):
        if argv[i] == name and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith(name + "="):
            value = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return value, rest


def whole_number(least: int):
    """An argparse `type` taking a whole number of at least `least` (`tunebook chat`, `tunebook evaluate`)."""

    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
        return int(text)

    return parse
