"""gradmerge's import graph: no cycles, and the layers of docs/architecture.md.

The graph is read from the source (every ``import``/``from ... import`` statement of every module
under ``gradmerge/``, ``__main__`` modules included, resolved to a gradmerge module), so the test
needs no imports and sees deferred imports inside functions too. The rules:

- at import time (statements at module level, ``if TYPE_CHECKING:`` blocks left out) the modules
  import one another without a cycle;
- counting deferred imports as well (those inside functions), the modules import one another
  without a cycle either: a function-level import does not hide one;
- counting deferred imports as well, the parts of the package (``gradmerge.<part>``: a subpackage
  or a top-level module) depend on one another without a cycle; importing the root ``gradmerge``
  (the public facade) is not counted here;
- the layers (:data:`LAYERS`: every part belongs to exactly one) import only the layers
  :data:`MAY_IMPORT` allows, deferred imports and ``TYPE_CHECKING`` blocks counted. Among them:
  foundation ↛ every other layer (the helpers of ``gradmerge.foundation`` and the typed errors
  import only one another); core ↛ kernels, io, jobs, estimate (core imports only core and the
  foundation); io ↛ jobs, estimate, commands;
  distributed ↛ commands. Importing the root facade counts as importing what the facade
  imports, so it is refused where those are;
- ``gradmerge.distributed`` imports neither ``gradmerge.commands`` nor ``argparse``: the command
  line (:mod:`gradmerge.commands`) uses the distributed library, never the other way round.
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
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = file
    return modules


MODULES = _modules()


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _statements(tree: ast.Module, deferred: bool, typing: bool = False) -> list[ast.stmt]:
    """Import statements: at module level only, or everywhere (``deferred``); ``typing``: also
    those of ``if TYPE_CHECKING:`` blocks."""
    found: list[ast.stmt] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child) and not typing:
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            if deferred or not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child)  # a function's body runs later, not at import time

    visit(tree)
    return found


def _imports(module: str, deferred: bool, typing: bool = False) -> dict[str, set[str]]:
    """External module names (``argparse``) and gradmerge modules that ``module`` imports."""
    file = MODULES[module]
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in _statements(ast.parse(file.read_text()), deferred, typing):
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


LAYERS: dict[str, tuple[str, ...]] = {
    # the floor: the internal helpers and the typed errors (public, at the root), importing nothing
    # above them
    "foundation": ("gradmerge.foundation", "gradmerge.errors", "gradmerge._version"),
    "core": (
        "gradmerge.bootstrap",
        "gradmerge.params",
        "gradmerge.merge",
        "gradmerge.diagnostics",
        "gradmerge.curvature",
        "gradmerge.solvers",
        "gradmerge.elementwise",
    ),
    "kernels": ("gradmerge.kernels",),
    "estimate": ("gradmerge.estimate", "gradmerge.evaluation"),  # over (model, data, loss)
    "io": ("gradmerge.io",),
    "methods": ("gradmerge.methods",),  # one module per merge/removal method, and the registry
    "jobs": ("gradmerge.jobs",),
    "distributed": ("gradmerge.distributed",),
    "commands": ("gradmerge.commands", "gradmerge.cli", "gradmerge.__main__"),
    "testbed": ("gradmerge.demo", "gradmerge.theory"),
    "facade": ("gradmerge",),
}
"""The layers of docs/architecture.md, as parts of the package (``gradmerge.<part>``)."""

BELOW_JOBS = ("foundation", "core", "kernels", "estimate", "io", "methods")
MAY_IMPORT: dict[str, set[str]] = {
    "foundation": {"foundation"},
    "core": {"foundation", "core"},
    "kernels": {"foundation", "core"},
    "estimate": {"foundation", "core"},
    "io": {"foundation", "core"},
    "methods": {"foundation", "core"},
    "jobs": {*BELOW_JOBS},
    "distributed": {*BELOW_JOBS, "jobs"},
    "commands": {*BELOW_JOBS, "jobs", "distributed", "testbed", "facade"},
    "testbed": {"foundation", "core", "estimate", "facade"},
    "facade": {*BELOW_JOBS, "jobs", "distributed"},
}
"""Which layers each layer may import (itself always); the facade counts as what ``import
gradmerge`` loads (foundation, core and estimate)."""


def _layer(module: str) -> str:
    part = "gradmerge" if module == "gradmerge" else _part(module)
    found = [name for name, parts in LAYERS.items() if part in parts]
    assert len(found) == 1, f"{part} belongs to {found or 'no layer'}: add it to LAYERS"
    return found[0]


def _layer_imports(module: str) -> set[str]:
    """The layers ``module`` imports (deferred and TYPE_CHECKING imports counted); importing the
    root facade counts as importing every layer ``import gradmerge`` loads."""
    facade = _facade_layers()
    out: set[str] = set()
    for target in _imports(module, deferred=True, typing=True)["gradmerge"]:
        layer = _layer(target)
        out |= facade if layer == "facade" and _layer(module) != "facade" else {layer}
    return out


MACHINERY = ("gradmerge.distributed", "gradmerge.io", "gradmerge.jobs", "gradmerge.kernels")
"""The checkpoint and distributed machinery the facade offers (``gm.jobs``, ``gm.run_merge``, ...)
without counting as importing it: a user's first access loads it."""


def _facade_layers() -> set[str]:
    """The layers importing the facade counts as: those of the in-memory rules and estimation it
    re-exports (every name, these included, loads on first access: ``import gradmerge`` itself
    loads the errors and the version only), not :data:`MACHINERY`."""
    imports = _imports("gradmerge", deferred=False, typing=True)["gradmerge"]
    return {_layer(t) for t in imports if not t.startswith(MACHINERY)} | {"facade"}


def test_the_walk_sees_the_package():
    assert {"gradmerge.io.sources", "gradmerge.commands.curvature", "gradmerge.distributed"} <= set(
        MODULES
    )
    assert "gradmerge.distributed.__main__" in MODULES  # scripts are checked too
    deferred = _imports("gradmerge.commands.curvature", deferred=True)["gradmerge"]
    assert "gradmerge.distributed.estimate" in deferred
    typing = _imports("gradmerge", deferred=False, typing=True)["gradmerge"]
    assert (
        "gradmerge.jobs" in typing
        and "gradmerge.jobs" not in _imports("gradmerge", False)["gradmerge"]
    )


def test_every_part_belongs_to_one_layer():
    assert {m: _layer(m) for m in MODULES}  # _layer asserts


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layers_import_only_what_they_may(layer):
    offenders = {
        module: sorted(bad)
        for module in MODULES
        if _layer(module) == layer and (bad := _layer_imports(module) - MAY_IMPORT[layer] - {layer})
    }
    assert offenders == {}, f"{layer} may import only {sorted(MAY_IMPORT[layer])}"


@pytest.mark.parametrize(
    ("layer", "refused"),
    [
        ("foundation", {"core", "kernels", "io", "methods", "jobs", "estimate", "commands"}),
        ("core", {"kernels", "io", "methods", "jobs", "estimate"}),
        ("methods", {"kernels", "io", "jobs", "estimate", "commands"}),
        ("io", {"jobs", "estimate", "commands"}),
        ("distributed", {"commands"}),
    ],
)
def test_the_rules_of_the_issue_are_among_them(layer, refused):
    """Issue 20 item 7, stated as in docs/architecture.md: these stay refused."""
    assert not refused & (MAY_IMPORT[layer] | {layer})
    if "estimate" in refused:  # the facade imports estimate: importing it is refused too
        assert "estimate" in _facade_layers() and "facade" not in MAY_IMPORT[layer]


def test_the_layer_check_catches_an_offender(monkeypatch, tmp_path):
    """A core module that imports io, and an io module that imports the facade (hence estimate),
    are both reported: the check is not vacuous."""
    bad_core = tmp_path / "bad_core.py"
    bad_core.write_text("def f():\n    from gradmerge.io import reader\n")
    bad_io = tmp_path / "bad_io.py"
    bad_io.write_text("import gradmerge\n")
    monkeypatch.setitem(MODULES, "gradmerge.merge_extra", bad_core)
    monkeypatch.setitem(MODULES, "gradmerge.io.extra", bad_io)
    monkeypatch.setitem(LAYERS, "core", (*LAYERS["core"], "gradmerge.merge_extra"))
    assert "io" in _layer_imports("gradmerge.merge_extra")
    assert "estimate" in _layer_imports("gradmerge.io.extra")
    with pytest.raises(AssertionError, match="core may import only"):
        test_layers_import_only_what_they_may("core")
    with pytest.raises(AssertionError, match="io may import only"):
        test_layers_import_only_what_they_may("io")


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


def _deferred_graph() -> dict[str, set[str]]:
    """Module → the gradmerge modules it imports anywhere (in functions too; ``TYPE_CHECKING``
    blocks and the root facade left out: the former never run, the latter is the public API)."""
    return {
        m: {t for t in _imports(m, deferred=True)["gradmerge"] if t != "gradmerge"}
        for m in MODULES
        if m != "gradmerge"
    }


def test_no_cycle_hidden_in_a_function():
    """An import inside a function runs later, so Python tolerates a cycle it closes; but the two
    modules still need each other and neither can be understood, tested or moved alone. Counting
    the imports inside functions, no module imports itself through others."""
    assert _cycle(_deferred_graph()) is None, "modules import one another through functions"


def test_a_cycle_hidden_in_a_function_is_found(monkeypatch, tmp_path):
    """Two modules that import each other, one of them only inside a function, are reported: the
    check is not vacuous."""
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text("from gradmerge.io import second_extra\n")
    second.write_text("def f():\n    from gradmerge.io.first_extra import g\n")
    monkeypatch.setitem(MODULES, "gradmerge.io.first_extra", first)
    monkeypatch.setitem(MODULES, "gradmerge.io.second_extra", second)
    assert _cycle({m: _imports(m, deferred=False)["gradmerge"] for m in MODULES}) is None
    found = _cycle(_deferred_graph())
    assert found is not None and set(found) == {
        "gradmerge.io.first_extra",
        "gradmerge.io.second_extra",
    }


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
