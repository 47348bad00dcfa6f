"""Shared by the benchmark scripts: the machine and versions, and writing a section of RESULTS.md."""

from __future__ import annotations

import os
import platform
import re
import shlex
import sys
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(
            next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")).split()[1]
        )
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration):
        pass
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", GPU {torch.cuda.get_device_name()}"
    except ImportError:
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores{mem}{gpu}; {platform.system()} {platform.release()}"


def versions(*extra: str) -> str:
    import importlib.metadata as md

    names = ["torch", "transformers", "accelerate", "datasets", "tunebook", *extra]
    found = []
    for name in names:
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    return f"Python {platform.python_version()}, " + ", ".join(found)


def header(title: str, *extra_packages: str) -> list[str]:
    """The opening lines of a RESULTS.md section: its title, the machine, the versions and the command."""
    return [
        f"## {title}",
        "",
        f"- Machine: {machine()}",
        f"- Versions: {versions(*extra_packages)}",
        f"- Command: `{command()}`",
    ]


def command() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def write_section(name: str, body: str) -> None:
    """Replace (or append) the section between `<!-- name -->` markers in RESULTS.md."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n\n_Recorded {date.today().isoformat()}._\n{end}"
    text = (
        RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\nWritten by the scripts in this folder.\n"
    )
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)
