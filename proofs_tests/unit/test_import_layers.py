"""gradmerge's import graph: no cycles, and the library never imports the command line.

The graph is read from the source (every ``import``/``from ... import`` statement of every module
under ``gradmerge/``, resolved to a gradmerge module), so the test needs no imports and sees
deferred imports inside functions too. Three rules:

- at import time (statements at module level, ``if TYPE_CHECKING:`` blocks left out) the modules
  import one another without a cycle;
- counting deferred imports as well, the parts of the package (``gradmerge.<part>``: a subpackage
  or a top-level module) depend on one another without a cycle; importing the root ``gradmerge``
  (the public facade, e.g. for ``__version__``) is not counted;
- ``gradmerge.distributed`` imports neither ``gradmerge.commands`` nor ``argparse``: the command
  line (:mod:`gradmerge.commands`) uses the distributed library, never the other way round.

``__main__`` modules are scripts (``python -m gradmerge.distributed`` starts the command line),
not part of the library: they are left out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import gradmerge

ROOT = Path(gradmerge.__file__).parent


def _modules() -> dict[str, Path]:
    modules = {}
    for file in ROOT.rglob("*.py"):
        parts = list(file.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = file
    return modules


MODULES = _modules()


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _statements(tree: ast.Module, deferred: bool) -> list[ast.stmt]:
    """Import statements: at module level only, or everywhere (``deferred``)."""
    found: list[ast.stmt] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            if deferred or not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child)  # a function's body runs later, not at import time

    visit(tree)
    return found


def _imports(module: str, deferred: bool) -> dict[str, set[str]]:
    """External module names (``argparse``) and gradmerge modules that ``module`` imports."""
    file = MODULES[module]
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in _statements(ast.parse(file.read_text()), deferred):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        assert isinstance(node, ast.ImportFrom)
        base = node.module or ""
        if node.level:
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parent, base] if base else parent)
        for alias in node.names:
            name = f"{base}.{alias.name}"
            targets.add(name if name in MODULES else base)
    return {
        "gradmerge": {t for t in targets if t in MODULES and t != module},
        "other": {t.partition(".")[0] for t in targets if not t.startswith("gradmerge")},
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (a list of nodes, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def _part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_the_walk_sees_the_package():
    assert {"gradmerge.io.sources", "gradmerge.commands.curvature", "gradmerge.distributed"} <= set(
        MODULES
    )
    deferred = _imports("gradmerge.commands.curvature", deferred=True)["gradmerge"]
    assert "gradmerge.io.sources" in deferred


@pytest.mark.parametrize(
    ("graph", "cycle"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"a"}}, ["a", "a"]),
        ({"a": {"b", "c"}, "b": {"c"}, "c": {"b"}}, ["b", "c", "b"]),
    ],
)
def test_cycle_finder(graph, cycle):
    assert _cycle(graph) == cycle


def test_no_cycle_at_import_time():
    graph = {m: _imports(m, deferred=False)["gradmerge"] for m in MODULES}
    assert _cycle(graph) is None, "modules import one another at import time"


def test_parts_depend_on_one_another_without_a_cycle():
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        if module == "gradmerge":
            continue
        for target in _imports(module, deferred=True)["gradmerge"]:
            if target != "gradmerge" and _part(target) != _part(module):
                graph.setdefault(_part(module), set()).add(_part(target))
    assert _cycle(graph) is None, "parts of gradmerge depend on one another in a cycle"


def test_distributed_knows_no_command_line():
    offenders = {}
    for module in MODULES:
        if module.startswith("gradmerge.distributed"):
            found = _imports(module, deferred=True)
            bad = {t for t in found["gradmerge"] if t.startswith("gradmerge.commands")}
            bad |= found["other"] & {"argparse"}
            if bad:
                offenders[module] = sorted(bad)
    assert offenders == {}


def test_importing_distributed_loads_no_command():
    code = (
        "import sys, gradmerge.distributed, gradmerge.distributed.launch, "
        "gradmerge.distributed.merge, gradmerge.io.sources\n"
        "print(sorted(m for m in sys.modules if m.startswith('gradmerge.commands') "
        "or m in ('argparse', 'gradmerge.cli')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    loaded = [name for name in ast.literal_eval(out.strip()) if name != "argparse"]  # torch's
    assert loaded == []
