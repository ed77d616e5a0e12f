"""The tables of docs/config.md, generated from the settings' declarations.

Each YAML key and option is declared once (:mod:`gradmerge.foundation.settings`, the fields of
:mod:`gradmerge.jobs.config`, :class:`gradmerge.KroneckerCG`, :class:`gradmerge.EstimateOptions`
and :class:`gradmerge.jobs.refine.RefineConfig`); this module renders those
declarations — with the registry's say on which method uses which key — as the page's tables,
and the records' ``docs`` lines as its lists of methods, between ``<!-- generated: NAME -->`` and
``<!-- end generated -->`` lines. ``proofs_tests/docs/test_config_reference.py`` checks that the
committed page equals what :func:`tables` gives (with the commands' flags,
:mod:`gradmerge.commands.reference`, which sits above the jobs); after changing a declaration,
rewrite the page with

    python -m gradmerge.commands.reference docs/config.md

Example:
    >>> print(tables()["term"].splitlines()[2])
    | `delta` | 0 | δ ≥ 0. In Python: `prior=δ` (a float). |
"""

from __future__ import annotations

import re
from typing import Any

from gradmerge.estimate.options import EstimateOptions
from gradmerge.foundation.settings import REQUIRED, Setting, declared, default_of
from gradmerge.io.text_records import TextOptions
from gradmerge.jobs.config import MergeConfig, Remerge, RemoveConfig
from gradmerge.jobs.inputs import CurvatureTerm, ModelInput
from gradmerge.jobs.options import Options, ordered
from gradmerge.jobs.refine import RefineConfig, TaskInput
from gradmerge.methods import registry
from gradmerge.methods.base import Command
from gradmerge.solvers.spec import KroneckerCG

_BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def tables() -> dict[str, str]:
    """Every generated table of docs/config.md, by block name."""
    shared = declared(Options)
    return {
        "merge": _table(MergeConfig, [k for k in ordered(MergeConfig) if k not in shared], "merge"),
        "models": _table(ModelInput, list(declared(ModelInput)), "merge"),
        "remove": _table(
            RemoveConfig, [k for k in ordered(RemoveConfig) if k not in shared], "remove"
        ),
        "remerge": _table(Remerge, list(declared(Remerge)), "remove"),
        "term": _table(CurvatureTerm, list(declared(CurvatureTerm)), None),
        "options": _table(Options, list(shared), None),
        "solver": _table(KroneckerCG, list(declared(KroneckerCG)), None),
        "estimate": _table(EstimateOptions, list(declared(EstimateOptions)), None, flags=True),
        "refine": _table(RefineConfig, list(declared(RefineConfig)), None),
        "refine_models": _table(TaskInput, list(declared(TaskInput)), None),
        "text": _table(TextOptions, list(declared(TextOptions)), None, flags=True),
        "names": _names(),
        "merge_methods": registry.docs_list("merge"),
        "remove_methods": registry.docs_list("remove"),
    }


def _table(cls: Any, keys: list[str], job: Command | None, *, flags: bool = False) -> str:
    """The rows of ``keys``: the key, the methods that use it (``job``), its command-line flag
    (``flags``), its default and its meaning."""
    settings = declared(cls)
    head = ["key", *(["methods"] if job else []), *(["flag"] if flags else []), "default"]
    head.append("meaning")
    rows = [_row(head), _row(["---"] * len(head))]
    for key in keys:
        s = settings[key]
        cells = [f"`{key}`"]
        if job:
            cells.append(_methods(key, s, job))
        if flags:
            cells.append(f"`{s.flag}`" if s.flag else "—")
        cells += [_default(cls, key, s), _meaning(s)]
        rows.append(_row(cells))
    return "\n".join(rows) + "\n"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _methods(key: str, s: Setting, job: Command) -> str:
    """Which methods of ``job`` require or allow the key ("all": every method reads it)."""
    if key == "method":
        return "—"
    per_method = _per_method(job)
    if s.requires in per_method:
        users = [f"`{m.name}`" for m in registry.methods(job) if s.requires in m.uses]
        return f"with `{s.requires}`: {', '.join(users)}"
    if not s.per_method:
        return "all"
    found = {
        need: [f"`{m.name}`" for m in registry.methods(job) if m.need(key) == need]
        for need in ("required", "optional")
    }
    parts = []
    if found["required"]:
        parts.append(f"required by {', '.join(found['required'])}")
    if found["optional"]:
        parts.append(f"optional for {', '.join(found['optional'])}")
    return "; ".join(parts) + "; refused by the others"


def _per_method(job: Command) -> set[str]:
    from gradmerge.jobs.config import KEYS

    return set(KEYS[job])


def _default(cls: Any, key: str, s: Setting) -> str:
    if s.default_doc is not None:
        return s.default_doc
    value = default_of(cls, key)
    if value is REQUIRED:
        return "required"
    if value is None:
        return "—"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, tuple):
        return "`[]`" if not value else f"`{list(value)}`"
    return f"{value:g}"


def _meaning(s: Setting) -> str:
    text = s.doc
    if s.choices:
        text += f" One of {', '.join(f'`{c}`' for c in s.choices)}."
    if s.bounds() and s.kind in ("number", "integer") and s.bounds() not in text:
        text += f" Must be {s.bounds()}."
    if s.source:
        text += f" Default from {s.source}."
    if s.python:
        text += f" In Python: {s.python}."
    return text.replace("|", "\\|").replace("\\\\|", "\\|")


def _names() -> str:
    """YAML key → its name in the in-memory ``gm.*`` rules, where the two differ."""
    rows = [_row(["YAML key", "in Python (`gm.gradient_matching`, `gm.remove`, ...)"])]
    rows.append(_row(["---", "---"]))
    seen: set[tuple[str, str]] = set()
    for prefix, cls in (
        ("", MergeConfig),
        ("models[].", ModelInput),
        ("", RemoveConfig),
        ("prior.", CurvatureTerm),
        ("", Options),
    ):
        for key, s in declared(cls).items():
            if s.python and (prefix + key, s.python) not in seen:
                seen.add((prefix + key, s.python))
                rows.append(_row([f"`{prefix}{key}`", s.python]))
    return "\n".join(rows) + "\n"


def render(text: str, generated: dict[str, str] | None = None) -> str:
    """``text`` (docs/config.md) with every generated block replaced by its table:
    ``generated`` (default :func:`tables`; :func:`gradmerge.commands.reference.tables` adds the
    commands' flags).

    Raises:
        KeyError: a block names no table.
    """
    found = tables() if generated is None else generated
    return _BLOCK.sub(lambda m: m.group(1) + found[m.group(2)] + m.group(4), text)


def blocks(text: str) -> dict[str, str]:
    """The generated blocks of ``text`` as they stand, by name."""
    return {m.group(2): m.group(3) for m in _BLOCK.finditer(text)}
