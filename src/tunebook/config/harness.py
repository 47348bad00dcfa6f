"""lm-evaluation-harness tasks named in a config (`eval_harness_tasks`) or on `tunebook evaluate`'s command line:
what each name means, and the one line that says so when it means nothing.

A name is a local task YAML (`dataset_path: json` with local files works offline), a directory of them (all its
tasks), or a task, group or tag of lm-eval's own registry. Reading that registry's index (~15,000 YAML files, ~6 s)
happens only when a name is not a local path, once per process (`task_manager` is cached).
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ..compat import lm_eval_task_entry
from ..errors import ConfigError, first_line

__all__ = ["INSTALL_EVAL", "HarnessTasks", "harness_tasks", "import_lm_eval", "require_lm_eval", "task_manager"]

INSTALL_EVAL = 'pip install "tunebook[eval]"'


def require_lm_eval(key: str = "eval_harness_tasks") -> None:
    """One line naming what to install when lm-evaluation-harness is missing."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(f"{key} runs lm-evaluation-harness, which is not installed here: {INSTALL_EVAL}")


def import_lm_eval():
    """`import lm_eval`, leaving the environment as it was: lm-eval 0.4.13 sets HF_XET_HIGH_PERFORMANCE=1 when it is
    imported (how hard huggingface_hub downloads), which a library must not decide for the whole process."""
    before = os.environ.get("HF_XET_HIGH_PERFORMANCE")
    try:
        import lm_eval
    finally:
        if before is None:
            os.environ.pop("HF_XET_HIGH_PERFORMANCE", None)
    return lm_eval


@dataclass(frozen=True)
class HarnessTasks:
    """What `TaskManager.load` takes for the names given: registry names and YAML file paths (`specs`), with the
    directories whose tasks were named (`include_paths`) and whether a registry name is among them (`registry`)."""

    specs: tuple[str, ...]
    include_paths: tuple[str, ...]
    registry: bool

    def manager(self):
        """lm-eval's `TaskManager` that loads these tasks (its index is read once per process)."""
        return task_manager(self.include_paths, self.registry)


@functools.lru_cache(maxsize=8)
def task_manager(include_paths: tuple[str, ...], defaults: bool):
    """lm-eval's `TaskManager` over these directories, and over its own registry with `defaults` (only then: its
    index is the slow part)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include_paths) or None, include_defaults=defaults)


def harness_tasks(names: list[str], key: str = "eval_harness_tasks") -> HarnessTasks:
    """Resolve `names` (see the module's docstring); a name that is none of them is a `ConfigError` naming it and
    `key`, with the closest registry name when one is close."""
    require_lm_eval(key)
    import_lm_eval()

    specs, include_paths, registry_names = [], [], []
    for name in names:
        path = Path(name).expanduser()
        if path.is_dir():
            found = task_manager((str(path.resolve()),), False).all_subtasks
            if not found:
                raise ConfigError(f"{key}: {name} is a directory with no lm-eval task YAML (a `task:` key) in it")
            include_paths.append(str(path.resolve()))
            specs += found
        elif path.suffix in (".yaml", ".yml") or "/" in name:
            if not path.is_file():
                raise ConfigError(f"{key}: {name}: no such task YAML file")
            try:
                entry = lm_eval_task_entry(path)
            except (ValueError, OSError) as error:  # lm-eval's "Unknown config shape", a YAML that does not parse
                entry, why = None, f" ({first_line(error)})"
            else:
                why = ""
            if entry is None:
                raise ConfigError(f"{key}: {name} names no task: an lm-eval task YAML has a `task:` (or `group:`) "
                                  f"key{why}")  # fmt: skip
            specs.append(str(path.resolve()))
        else:
            registry_names.append(name)
            specs.append(name)
    if registry_names:
        from lm_eval import __version__

        known = task_manager((), True).all_tasks
        for name in registry_names:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"{key}: {name!r} is neither a local task YAML (or a directory of them) nor a task, "
                                  f"group or tag of lm-eval {__version__}'s registry.{hint}")  # fmt: skip
    return HarnessTasks(tuple(specs), tuple(include_paths), bool(registry_names))
