"""The tests that run a real vLLM engine (`make test-vllm`; named so that it never shadows the `vllm` package): skipped where vLLM is not installed (CI, `make test`)."""

from __future__ import annotations

import importlib.util

import pytest


def pytest_collection_modifyitems(config, items):
    missing = importlib.util.find_spec("vllm") is None
    for item in items:
        if "tests/vllm_engine/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.vllm)
            if missing:
                item.add_marker(pytest.mark.skip(reason="vLLM is not installed (make vllm)"))
