"""The suite's own layout: no test module imports another (shared helpers live in plain modules such as
tests/support.py), and tests/unit mirrors the package, one folder per subpackage of src/tunebook."""

from __future__ import annotations

import ast

from support import ROOT

TESTS = ROOT / "tests"


def _imported(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_no_test_module_imports_another():
    test_modules = {p.stem for p in TESTS.rglob("test_*.py")} | {"conftest"}
    offenders = {
        str(path.relative_to(TESTS)): sorted(_imported(path) & test_modules)
        for path in TESTS.rglob("*.py")
        if _imported(path) & test_modules
    }
    assert not offenders, f"test modules imported by others (move shared code to a plain module): {offenders}"


# Subpackages whose tests are end to end by nature, and where they are.
TESTED_ELSEWHERE = {"recipes": "tests/recipes"}


def test_unit_tests_mirror_the_package():
    package = ROOT / "src" / "tunebook"
    subpackages = {p.parent.name for p in package.glob("*/__init__.py")} - set(TESTED_ELSEWHERE)
    folders = {p.name for p in (TESTS / "unit").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= subpackages, f"tests/unit folders with no package of that name: {sorted(folders - subpackages)}"
    untested = {name for name in subpackages - folders if any((package / name).glob("[!_]*.py"))}
    assert not untested, f"subpackages of tunebook with no tests/unit folder: {sorted(untested)}"


def test_test_files_have_unique_names():
    """pytest imports test files by name (no __init__.py here): two of one name would shadow each other."""
    seen: dict[str, str] = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        assert path.name not in seen, f"{path.relative_to(TESTS)} and {seen[path.name]} share a name"
        seen[path.name] = str(path.relative_to(TESTS))
