"""Typed, strict recipe configs (the machinery in `parsing`; the split into modules follows)."""

from .parsing import *  # noqa: F403
from .parsing import (  # noqa: F401
    TRACKERS,
    ConfigError,
    __all__,  # noqa: F401
    report_to_names,
)
