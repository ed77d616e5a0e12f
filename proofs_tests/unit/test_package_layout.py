"""The package's root shows the public face only (docs/architecture.md, "Layout"): every module at
``gradmerge/``'s top is public, the internal helpers live in ``gradmerge.foundation``, and a public
module path that moved is refused with its new home.

A root module is public when the facade offers it (``gm.NAME`` is the module), when the facade
imports its names eagerly (the typed errors, the version), when it is the command line's entry
point (pyproject's ``[project.scripts]``, ``python -m gradmerge``), or when the user docs import
it by name (``from gradmerge.bootstrap import paired_bootstrap`` in docs/commands.md).
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gradmerge as gm
from gradmerge.errors import MovedModuleError

PACKAGE = Path(gm.__file__).parent
REPO = PACKAGE.parent


def _root_modules() -> set[str]:
    return {f.stem for f in PACKAGE.glob("*.py")} - {"__init__"}


def _eager_facade_imports() -> set[str]:
    """The root modules ``gradmerge/__init__.py`` imports at module level (not lazily)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    return {
        node.module.split(".")[1]
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gradmerge.")
    }


def _entry_points() -> set[str]:
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    scripts = re.findall(r'^\w+ = "gradmerge\.(\w+):\w+"', text, flags=re.MULTILINE)
    return {*scripts, "__main__"}


def _documented() -> set[str]:
    """Root modules the user docs import by their path (``gradmerge.NAME``)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found: set[str] = set()
    for page in pages:
        found |= set(re.findall(r"\bgradmerge\.(\w+)\b", page.read_text(encoding="utf-8")))
    return found


def test_every_root_module_is_public():
    offered = {name for name in gm._MODULES if (PACKAGE / f"{name}.py").is_file()}
    public = offered | _eager_facade_imports() | _entry_points() | _documented()
    private = sorted(_root_modules() - public)
    assert private == [], (
        f"{private} at gradmerge/'s root are not public: move each where it belongs "
        "(an internal helper to gradmerge/foundation/, a merge family to gradmerge/merge/)"
    )


def test_the_root_is_what_the_architecture_page_shows():
    """The root's modules are exactly the public ones docs/architecture.md lists, and the only
    private file there is ``_version.py`` (the home of ``gm.__version__``, read by pyproject)."""
    assert _root_modules() == {
        *("__main__", "_version", "bootstrap", "cli", "diagnostics", "errors", "evaluation"),
        "params",
    }
    assert _eager_facade_imports() >= {"errors", "_version", "foundation"}
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    layout = page[page.index("## Layout") :]
    for name in _root_modules() - {"__main__"}:
        assert f"{name}.py" in layout, f"docs/architecture.md's layout does not show {name}.py"
    for helper in ("settings", "guard", "files", "readahead", "devices", "extras", "lazy", "text"):
        assert (PACKAGE / "foundation" / f"{helper}.py").is_file()
        assert f"{helper}.py" in layout, f"docs/architecture.md's layout does not show {helper}.py"


@pytest.mark.parametrize(
    "statement",
    [
        "import gradmerge.settings",
        "from gradmerge.settings import setting",
        "from gradmerge import settings",
    ],
)
def test_a_moved_public_module_is_refused_with_its_new_home(statement):
    with pytest.raises(
        MovedModuleError, match=r"gradmerge\.settings moved to gradmerge\.foundation\.settings"
    ):
        exec(statement, {})
    assert issubclass(MovedModuleError, ModuleNotFoundError)  # code catching ImportError still does


def test_the_new_home_imports_and_other_missing_modules_fail_as_usual():
    assert importlib.import_module("gradmerge.foundation.settings").setting is not None
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module("gradmerge.no_such_module")
    assert not isinstance(info.value, MovedModuleError)
    # the private helpers moved without a forwarding module: their old files are gone
    for old in ("_guard", "_files", "_text", "_lazy", "_extras", "_devices", "_readahead"):
        assert not (PACKAGE / f"{old}.py").exists()


def test_a_fresh_process_refuses_the_old_path():
    """The refusal is in place as soon as ``gradmerge`` is imported (here by the import itself)."""
    done = subprocess.run(
        [sys.executable, "-c", "import gradmerge.settings"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "gradmerge.errors.MovedModuleError: gradmerge.settings moved to "
        "gradmerge.foundation.settings (gradmerge is 0.x); import gradmerge.foundation.settings "
        "instead, e.g. `from gradmerge.foundation.settings import ...`"
    )
