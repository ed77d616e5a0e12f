"""Public names of a package imported on first access (PEP 562), so that importing it stays light.

At the package's top because three facades use it: ``gradmerge`` itself, ``gradmerge.jobs`` and
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
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any


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
