"""Optional dependencies, grouped as the package's extras, checked where a feature needs them.

In the foundation because io, the demo and the theory testbed each check their extra through
it (no one package is its main user).

``pip install .`` in a clone brings what the merge core, curvature estimation on tensors or entry
points and the checkpoint commands need (torch, numpy, safetensors, pyyaml, tqdm). Three features
need more, each declared as an extra of ``pyproject.toml``:

==========  ========================================  ============================================
extra       modules                                   needed by
==========  ========================================  ============================================
testbed     sympy                                     ``gradmerge verify``, ``gradmerge.theory``
demo        sklearn, matplotlib, scipy                ``gradmerge demo``, ``gradmerge.demo``
hf          transformers, tokenizers                  Hugging Face model folders, text DATA
==========  ========================================  ============================================

``import gradmerge`` imports none of them; a feature that needs one calls :func:`require`
first, which raises :class:`~gradmerge.errors.MissingExtraError` naming the extra to install
instead of a bare ``ModuleNotFoundError`` from deep inside.

Example:
    >>> from gradmerge.foundation.extras import require
    >>> require("testbed", "the theory testbed")  # sympy is there: returns None
"""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

from gradmerge.errors import MissingExtraError

EXTRAS: dict[str, tuple[str, ...]] = {
    "testbed": ("sympy",),
    "demo": ("sklearn", "matplotlib", "scipy"),
    "hf": ("transformers", "tokenizers"),
}
"""Each extra of ``pyproject.toml`` and the modules (import names) it provides."""


def require(extra: str, feature: str) -> None:
    """Find every module of ``extra``; raise a :class:`MissingExtraError` if one is missing.

    The modules are looked up (``importlib.util.find_spec``), not imported: the check costs
    microseconds, and the feature imports what it uses when it uses it.

    Args:
        extra: a key of :data:`EXTRAS`.
        feature: what needs it, for the message (``"gradmerge demo"``).

    Raises:
        MissingExtraError: a module of the extra cannot be imported; the message says which,
            and the ``pip install`` command that brings it.
    """
    missing = []
    for module in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a finder that refuses it, a broken module entry
            found = False
        if not found:
            missing.append(module)
    if missing:
        raise MissingExtraError(
            f"{feature} needs the optional dependencies of gradmerge's '{extra}' extra, and "
            f"{', '.join(missing)} cannot be imported; install them with "
            f"{install_command(extra)}",
            extra=extra,
            missing=tuple(missing),
        )


def install_command(extra: str) -> str:
    """The ``pip install`` command that brings ``extra``, in the form that works: gradmerge is
    not on the package index, so it names the source folder gradmerge runs from (an editable
    install or a clone on ``sys.path``: ``pip install '/path/to/gradmerge[hf]'``), or, for a
    copy installed from a wheel, ``.`` in a clone of the repository. The README's Install
    section uses the same form (``pip install '.[hf]'``); both are resolved by the docs tests.

    Example:
        >>> install_command("hf").startswith("pip install ") and "[hf]" in install_command("hf")
        True
    """
    root = Path(__file__).resolve().parents[2]  # the folder above gradmerge/foundation/
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and 'name = "gradmerge"' in pyproject.read_text(encoding="utf-8"):
        return f"pip install {shlex.quote(f'{root}[{extra}]')}"
    return f"pip install '.[{extra}]' in a clone of gradmerge's repository"
