"""Python entry points: ``module:function`` or ``path/to/file.py:function``, and their arguments.

MODEL and DATA may name a function that returns the model or the batches
(:mod:`gradmerge.io.sources`); this module finds and calls it, with the keyword arguments of
``--model-arg`` / ``--data-arg`` (``KEY=VALUE``, :func:`parse_argument`). A file is imported
under a name derived from its path, with its folder importable while it runs.

Example:
    >>> parse_argument("task=b")
    ('task', 'b')
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

from gradmerge.errors import ArgumentError


def split_entry_point(spec: str) -> tuple[str, str]:
    module, _, attr = spec.rpartition(":")
    if not module or not attr.isidentifier():
        raise ArgumentError(
            f"{spec!r} is not an entry point: expected module:function or path/to/file.py:function"
        )
    return module, attr


def parse_argument(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` (``--model-arg``/``--data-arg``) as ``(key, value)``: the value read as JSON
    when it is (``3``, ``0.5``, ``true``, ``[1, 2]``, ``"a b"``), else kept as text.

    Example:
        >>> parse_argument("task=b"), parse_argument("n=3"), parse_argument("ids=[1, 2]")
        (('task', 'b'), ('n', 3), ('ids', [1, 2]))
    """
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise ArgumentError(
            f"expected KEY=VALUE with a Python identifier as KEY (e.g. task=sentiment), got {text!r}"
        )
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def call_entry_point(spec: str, what: str, arguments: Mapping[str, Any] | None = None) -> Any:
    """Call the function ``spec`` names (:func:`entry_point`) with the keyword ``arguments``.

    Raises:
        ArgumentError: what :func:`entry_point` raises; arguments the function does not take.
    """
    function = entry_point(spec, what)
    arguments = dict(arguments or {})
    try:
        inspect.signature(function).bind(**arguments)
    except TypeError as err:
        given = ", ".join(f"{k}={v!r}" for k, v in arguments.items()) or "no arguments"
        raise ArgumentError(
            f"{what} entry point {spec} cannot be called with {given} ({err}); its signature is "
            f"{spec.rpartition(':')[2]}{inspect.signature(function)}"
        ) from err
    except ValueError:  # no signature (some builtins): let the call decide
        pass
    return function(**arguments)


def entry_point(spec: str, what: str) -> Callable[..., Any]:
    """The function ``module:function`` or ``path/to/file.py:function`` names.

    The current folder is importable (as with ``python -m``); a file's own folder is importable
    while it is loaded, so it can import its neighbours.

    Raises:
        ArgumentError: a module or file that cannot be found, a missing or non-callable name.
    """
    module_name, attr = split_entry_point(spec)
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        module = _module_from_file(Path(module_name), what)
    else:
        try:
            with _importable(os.getcwd()):
                module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is None or not module_name.startswith(err.name):
                raise  # the module exists but one of ITS imports is missing: show that
            raise ArgumentError(
                f"{what} entry point {spec}: no module named {err.name!r} (run from the folder "
                "that holds it, install it, or give path/to/file.py:function)"
            ) from err
    function = getattr(module, attr, None)
    if function is None:
        raise ArgumentError(f"{what} entry point {spec}: {module_name} has no {attr!r}")
    if not callable(function):
        raise ArgumentError(
            f"{what} entry point {spec}: {attr!r} is a {type(function).__name__}; expected a "
            "function"
        )
    return cast(Callable[..., Any], function)


def _module_from_file(path: Path, what: str) -> Any:
    if not path.is_file():
        raise ArgumentError(f"{what} entry point: no Python file at {path}")
    name = "_gradmerge_entry_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ArgumentError(f"{what} entry point: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with _importable(str(path.resolve().parent)):
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


@contextlib.contextmanager
def _importable(folder: str) -> Iterator[None]:
    """``folder`` at the front of ``sys.path`` while the block runs."""
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)
