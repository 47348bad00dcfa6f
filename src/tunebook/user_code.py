"""Functions from a user's own Python file (`path/to/file.py:function`, as GRPO's reward functions), and one line
for whatever such code raises. No heavy imports: the config check loads the file before torch does.
"""

from __future__ import annotations

import importlib.util
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from .errors import ConfigError

__all__ = ["load_function", "user_failure"]


def load_function(spec: str, what: str) -> Callable:
    """The function `name` of `path/to/file.py:name`; `what` says what it is for ("reward function"). A missing
    file, a file that does not import (a syntax error, an import error, anything raised at its import) and a
    missing or non-callable name are each one ConfigError naming the spec."""
    path, _, name = spec.rpartition(":")
    file = Path(path).expanduser()
    if not path or not name:
        raise ConfigError(f"{what} {spec!r}: expected path/to/file.py:function_name")
    if not file.is_file():
        raise ConfigError(f"{what} {spec!r}: file not found: {path}")
    module = _load_module(file, spec, what)
    if not hasattr(module, name):
        raise ConfigError(f"{what} {spec!r}: {path} defines no function {name!r}")
    fn = getattr(module, name)
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r}: {name!r} in {path} is a {type(fn).__name__}, not a function")
    return fn


# Files already run in this process, by path and version: the config check, the recipe's own config load and the run
# itself each ask for a reward file, and what the file does at import (downloads, prints) should happen once.
_MODULES: dict[tuple[Path, int, int], ModuleType] = {}


def _load_module(file: Path, spec: str, what: str) -> ModuleType:
    stat = file.stat()
    key = (file.resolve(), stat.st_mtime_ns, stat.st_size)  # an edited file is run again
    if key in _MODULES:
        return _MODULES[key]
    module_spec = importlib.util.spec_from_file_location(f"tunebook_user_{file.stem}", file)
    if module_spec is None:  # not a .py file: importlib has no loader for it
        raise ConfigError(f"{what} {spec!r}: {file} is not a Python (.py) file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as error:  # the user's file, sys.exit at import included: name it, not our traceback
        raise ConfigError(f"{what} {spec!r}: importing {file} failed: {user_failure(error)}") from None
    _MODULES[key] = module
    return module


def user_failure(error: BaseException) -> str:
    """What user code raised, for one line: `KeyError: 'solution' (rewards.py, line 12)`, `SystemExit: sys.exit(3)
    (rewards.py, line 20)`; the place is the innermost frame of the traceback, where it was raised (a SyntaxError
    names its own).

    Callers catch `BaseException` less `KeyboardInterrupt` (Ctrl-C, which must reach the run so that it saves and
    stops) and `GeneratorExit` (a generator being closed, not a failure): `except Exception` lets `SystemExit` through,
    and a `sys.exit(3)` in user code then ended the run with the code 3 and no word of why."""
    if isinstance(error, SystemExit):
        what = f"SystemExit: sys.exit({error.code!r})"
    else:
        message = str(error).strip().splitlines()
        what = f"{type(error).__name__}: {message[0]}" if message else type(error).__name__
    if isinstance(error, SyntaxError):  # its own traceback ends in importlib; the message names file and line
        return what
    frames = traceback.extract_tb(error.__traceback__)
    return f"{what} ({Path(frames[-1].filename).name}, line {frames[-1].lineno})" if frames else what
