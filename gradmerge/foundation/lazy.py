"""Public names of a package imported on first access (PEP 562), so that importing it stays light;
and module paths that moved, refused with their new home.

In the foundation because three facades use it: ``gradmerge`` itself, ``gradmerge.jobs`` and
``gradmerge.io``.

Example:
    >>> import sys, types
    >>> pkg = types.ModuleType("pkg"); sys.modules["pkg"] = pkg
    >>> pkg.__getattr__, pkg.__dir__ = lazy_names("pkg", {"sqrt": "math", "json": "json"}, ["json"])
    >>> pkg.sqrt(4.0), pkg.json.__name__, "sqrt" in vars(pkg)
    (2.0, 'json', True)
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from gradmerge.errors import MovedModuleError


def lazy_names(
    package: str, names: Mapping[str, str], modules: Collection[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the package ``package``.

    ``names`` maps each public name to the module it lives in (absolute); a name in ``modules`` is
    that module itself. The first access imports the module and stores the value in the package,
    so that later accesses do not reach ``__getattr__``.
    """

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = importlib.import_module(module)
        if name not in modules:
            value = getattr(value, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__


class _MovedModules(importlib.abc.MetaPathFinder):
    """A finder of ``sys.meta_path`` that refuses the old paths of ``moved`` with their new home
    and answers ``None`` for every other name (the next finder looks for it as usual)."""

    def __init__(self, moved: Mapping[str, str]) -> None:
        self.moved = dict(moved)

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        new = self.moved.get(fullname)
        if new is None:
            return None
        raise MovedModuleError(
            f"{fullname} moved to {new} (gradmerge is 0.x); import {new} instead, e.g. "
            f"`from {new} import ...`"
        )


def refuse_moved(moved: Mapping[str, str]) -> None:
    """Refuse each old module path of ``moved`` (old → new, absolute) with a
    :class:`~gradmerge.errors.MovedModuleError` naming the new one, instead of Python's bare
    ``No module named ...``; ``import OLD`` and ``from PACKAGE import NAME`` alike.

    The finder goes first on ``sys.meta_path``: an old path names no module of this version, so
    a copy found anyway (a stale file of an older install, another checkout's editable install)
    would be the old code, imported silently beside the new. It answers only for the names of
    ``moved``. Calling this again with the same mapping adds nothing.

    Example:
        >>> refuse_moved({"json.old_home": "json.decoder"})
        >>> import json.old_home  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        gradmerge.errors.MovedModuleError: json.old_home moved to json.decoder ...
    """
    finder = _MovedModules(moved)
    if not any(isinstance(f, _MovedModules) and f.moved == finder.moved for f in sys.meta_path):
        sys.meta_path.insert(0, finder)
