"""Tunebook's modules import one another without a circle, and only downwards through the layers of
docs/architecture.md.

A circle (a imports b, b imports a) makes the order of imports matter: which module may use which at import time
depends on who was imported first, and a lazy import hides one only until the day it is moved to the top. The walk
reads every module of the package (the recipes included) with `ast`, resolving relative imports, and counts:

- imports at any depth: at module level, inside classes, `if` and `try` blocks, and inside functions. A
  function-level import still ties its module to the other one (b cannot be understood or moved without a), so it
  counts like any other, unless it is listed in `LAZY` with the reason it waits (import cost, say); then only the
  module-level graph must be free of it, and `test_no_circle_at_module_level` still fails on any circle made at
  import time;
- the packages an import initialises: `import tunebook.x.y` runs `tunebook/x/__init__.py` too, except where that
  package is one the importer is itself inside (it is initialised before any of its modules runs).

It does not see `importlib.import_module("...")` strings (the lazy names of `tunebook` and `tunebook.models`,
`load_recipe`): those load on first use, after every module is imported.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path

import tunebook

PACKAGE = Path(tunebook.__file__).parent

# (importer, imported): why the import waits inside a function. Edges listed here do not count in the graph of all
# imports; the module-level graph never contains them anyway.
_SUBCOMMAND = ("the CLI imports a subcommand's stack only when it runs: `tunebook --help`, `report` and the config "
               "check load no torch")  # fmt: skip
# The loop runs lm-evaluation-harness (an optional dependency) for every causal-LM recipe without code of its own,
# only when a config names tasks; the adapter belongs with what scores a model (evaluation/), one layer up.
_HARNESS = "the loop runs the config's eval_harness_tasks (lm-eval optional: imported only when named)"
LAZY: dict[tuple[str, str], str] = {
    ("tunebook.training.loop", "tunebook.evaluation"): _HARNESS,
    ("tunebook.training.loop", "tunebook.evaluation.harness"): _HARNESS,
    ("tunebook.cli.main", "tunebook.distributed"): _SUBCOMMAND,
    ("tunebook.cli.main", "tunebook.run.export"): _SUBCOMMAND,
    ("tunebook.cli.main", "tunebook.run"): _SUBCOMMAND,
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    where: str  # path:line of the import
    lazy: bool  # inside a function: runs when the function does, not at import


def package_modules(package: Path) -> dict[str, Path]:
    """Every module under `package` by its dotted name (following symlinked folders: `tunebook.recipes`)."""
    found = {}
    for root, dirs, files in os.walk(package, followlinks=True):
        dirs[:] = sorted(d for d in dirs if (Path(root) / d / "__init__.py").exists())
        for name in sorted(files):
            if name.endswith(".py"):
                parts = list((Path(root) / name).relative_to(package.parent).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                found[".".join(parts)] = Path(root) / name
    return found


def _imports(tree: ast.AST):
    """(node, inside a function) for every import statement of a module."""

    def walk(node, lazy):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, lazy
            yield from walk(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    yield from walk(tree, False)


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_edges(package: Path) -> list[Edge]:
    """Every import of one module of `package` by another, with the packages it initialises."""
    modules = package_modules(package)
    edges = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node, lazy in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per dot beyond the first
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join(here + ([node.module] if node.module else []))
                # `from package import submodule` imports the submodule; `from module import name`, the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` where only `a.b` is ours, or `a.b.name`
                    target = target.rpartition(".")[0]
                if not target:
                    continue
                inside = set(_ancestors(name)) | ({name} if is_package else set())
                for reached in [*_ancestors(target), target]:
                    if reached in modules and reached not in inside and reached != name:
                        where = f"{path.relative_to(package.parent)}:{node.lineno}"
                        edges.append(Edge(name, reached, where, lazy))
    return list(dict.fromkeys(edges))  # one edge per import statement and module reached


def find_circles(edges: list[Edge]) -> list[list[Edge]]:
    """The circles among the modules, as the edges that close each: found per strongly connected group (Tarjan),
    the shortest through each of its modules."""
    graph: dict[str, list[Edge]] = {}
    for edge in edges:
        graph.setdefault(edge.source, []).append(edge)
        graph.setdefault(edge.target, [])
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(node):  # iterative Tarjan: a recursive one would meet Python's recursion limit on a large package
        work = [(node, iter(graph[node]))]
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        while work:
            current, successors = work[-1]
            for edge in successors:
                if edge.target not in index:
                    index[edge.target] = low[edge.target] = len(index)
                    stack.append(edge.target)
                    on_stack.add(edge.target)
                    work.append((edge.target, iter(graph[edge.target])))
                    break
                if edge.target in on_stack:
                    low[current] = min(low[current], index[edge.target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[current])
                if low[current] == index[current]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == current:
                            break
                    if len(group) > 1:
                        groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    circles, seen = [], set()
    for group in groups:  # the shortest circle through each module of a group: every one to break is named
        for start in sorted(group):
            circle = _circle_from(start, group, graph)
            if frozenset((e.source, e.target) for e in circle) not in seen:
                seen.add(frozenset((e.source, e.target) for e in circle))
                circles.append(circle)
    return circles


def _circle_from(start: str, group: set[str], graph: dict[str, list[Edge]]) -> list[Edge]:
    """The shortest circle from `start` back to itself within its group (breadth first)."""
    paths = {start: []}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for edge in graph[node]:
            if edge.target == start:
                return paths[node] + [edge]
            if edge.target in group and edge.target not in paths:
                paths[edge.target] = paths[node] + [edge]
                queue.append(edge.target)
    raise AssertionError(f"no circle in the connected group {sorted(group)}")


def describe(circle: list[Edge]) -> str:
    modules = " -> ".join([circle[0].source] + [e.target for e in circle])
    imports = ", ".join(f"{e.where}{' (in a function)' if e.lazy else ''}" for e in circle)
    return f"{modules}  [{imports}]"


def _assert_no_circle(edges: list[Edge], which: str) -> None:
    circles = find_circles(edges)
    assert not circles, f"import circles ({which}):\n" + "\n".join(describe(c) for c in circles)


def test_no_circle_at_module_level():
    _assert_no_circle([e for e in import_edges(PACKAGE) if not e.lazy], "imports run at import time")


def test_no_circle_counting_imports_inside_functions():
    edges = [e for e in import_edges(PACKAGE) if (e.source, e.target) not in LAZY]
    _assert_no_circle(edges, f"all imports, but the {len(LAZY)} listed in LAZY")


def test_lazy_exceptions_are_imports_that_exist():
    edges = {(e.source, e.target) for e in import_edges(PACKAGE) if e.lazy}
    assert set(LAZY) <= edges, f"LAZY lists imports that are gone: {sorted(set(LAZY) - edges)}"


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_walk_finds_relative_lazy_and_package_circles(tmp_path):
    package = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a/__init__.py": "from .loaders import build\n",
        "pkg/a/loaders.py": "def build():\n    from .stream import Loader\n    return Loader\n",
        "pkg/a/stream.py": "from .loaders import build\nclass Loader: ...\n",
        "pkg/b/__init__.py": "from . import c\n",
        "pkg/b/c.py": "import os\nfrom pkg.d import e\n",
        "pkg/d/__init__.py": "",
        "pkg/b/other.py": "",
        "pkg/d/e.py": "import pkg.b.other\n",  # runs pkg.b's __init__, which imports c, which imports d.e
        "pkg/f.py": "from pkg.a import stream\n",  # no circle: pkg.a's modules do not import f
    })  # fmt: skip
    edges = import_edges(package)
    circles = [frozenset(e.source for e in circle) for circle in find_circles(edges)]
    assert sorted(circles, key=sorted) == [{"pkg.a.loaders", "pkg.a.stream"}, {"pkg.b", "pkg.b.c", "pkg.d.e"}]
    # the loaders' import waits inside a function: the module-level graph keeps only the other circle
    at_import = find_circles([e for e in edges if not e.lazy])
    assert [{e.source for e in c} for c in at_import] == [{"pkg.b", "pkg.b.c", "pkg.d.e"}]
    named = describe(next(c for c in find_circles(edges) if c[0].source.startswith("pkg.a")))
    assert named.startswith("pkg.a.loaders -> pkg.a.stream -> pkg.a.loaders")
    assert "pkg/a/loaders.py:2 (in a function)" in named and "pkg/a/stream.py:1" in named


# The layers of docs/architecture.md, lowest first: a module imports only from its own layer and those below. A layer
# is a subpackage of tunebook (or a top-level module) by name.
LAYERS = [
    {"errors", "locations", "compat", "progress", "process", "preparation", "user_code"},
    {"config", "recipe"},
    {"models"},
    {"data"},
    {"distributed"},
    {"run"},
    {"planning"},
    {"training"},
    {"evaluation"},
    {"preference"},
    {"rl"},
    {"distillation"},
    {"cli", "recipes", "tunebook"},
]
# (importer, imported): why it reaches up a layer.
UPWARDS: dict[tuple[str, str], str] = {
    ("tunebook.run.export", "tunebook.training"): "export reads a training checkpoint",
    ("tunebook.run.export", "tunebook.training.checkpoint"): "export reads a training checkpoint",
    ("tunebook.run.export", "tunebook.training.manifest"): "export verifies the checkpoint it reads",
    ("tunebook.training.loop", "tunebook.evaluation"): _HARNESS,
    ("tunebook.training.loop", "tunebook.evaluation.harness"): _HARNESS,
    ("tunebook.distributed", "tunebook.run"): "the preflight compares the library versions the run record reads",
    (
        "tunebook.distributed",
        "tunebook.run.record",
    ): "the preflight compares the library versions the run record reads",
}


def _layer(module: str) -> int:
    name = module.split(".")[1] if "." in module else module
    return next(rank for rank, layer in enumerate(LAYERS) if name in layer)


def test_imports_go_down_the_layers():
    upwards = [
        f"{edge.where}: {edge.source} imports {edge.target}"
        for edge in import_edges(PACKAGE)
        if _layer(edge.target) > _layer(edge.source) and (edge.source, edge.target) not in UPWARDS
    ]
    assert not upwards, "imports up the layers of docs/architecture.md:\n" + "\n".join(upwards)


def test_every_module_has_a_layer_and_every_exception_is_used():
    for module in package_modules(PACKAGE):
        _layer(module)  # StopIteration names a module no layer holds
    edges = {(edge.source, edge.target) for edge in import_edges(PACKAGE)}
    assert set(UPWARDS) <= edges, f"exceptions for imports that no longer exist: {sorted(set(UPWARDS) - edges)}"
