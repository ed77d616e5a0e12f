"""The registry: every merge and removal method of the YAML jobs, one module each, in a list.

Adding a method is writing its module (its rule and its ``METHOD`` record,
:class:`~gradmerge.methods.base.MergeMethod`) and adding it to :data:`REGISTRY`; the YAML
reader, the engine, ``--dry-run``, ``gradmerge merge --help`` and docs/config.md read the
record (docs/architecture.md, "Adding a method").

Example:
    >>> [m.name for m in methods("merge")]
    ['task_arithmetic', 'fisher_average', 'gradient_matching', 'regmean', 'tsv_merge', 'iso_c', 'iso_cts']
    >>> names("remove")
    ('remove', 'influence_remove', 'remerge')
    >>> get("fisher_average").need("damping"), get("fisher_average").need("prior")
    ('optional', 'forbidden')
    >>> refusal(get("task_arithmetic"), "damping")
    '`damping` is for fisher_average and regmean'
"""

from __future__ import annotations

from gradmerge.errors import ArgumentError
from gradmerge.methods import (
    fisher_average,
    gradient_matching,
    influence_remove,
    iso_c,
    iso_cts,
    regmean,
    remerge,
    remove,
    task_arithmetic,
    tsv_merge,
)
from gradmerge.methods.base import Command, MergeMethod

REGISTRY: tuple[MergeMethod, ...] = (
    task_arithmetic.METHOD,
    fisher_average.METHOD,
    gradient_matching.METHOD,
    regmean.METHOD,
    tsv_merge.METHOD,
    iso_c.METHOD,
    iso_cts.METHOD,
    remove.METHOD,
    influence_remove.METHOD,
    remerge.METHOD,
)
"""Every method, in the order the help, the docs and the error messages list them."""

_BY_NAME = {m.name: m for m in REGISTRY}


def methods(job: Command) -> tuple[MergeMethod, ...]:
    """The methods of one job, in registry order."""
    return tuple(m for m in REGISTRY if m.command == job)


def names(job: Command) -> tuple[str, ...]:
    """The ``method:`` values one job accepts."""
    return tuple(m.name for m in methods(job))


def get(name: str) -> MergeMethod:
    """The record of ``name``.

    Raises:
        ArgumentError: no method has that name (the message lists those that exist).
    """
    method = _BY_NAME.get(name)
    if method is None:
        raise ArgumentError(
            f"unknown method {name!r}: expected one of {', '.join(_BY_NAME)} "
            "(gradmerge.methods.registry.REGISTRY)"
        )
    return method


def refusal(method: MergeMethod, key: str, what: str = "") -> str:
    """Why ``key`` (``what`` it holds, for the message) is refused by ``method``: which methods
    of its job use it instead."""
    users = [m.name for m in methods(method.command) if key in m.uses]
    listed = " and ".join(filter(None, [", ".join(users[:-1]), *users[-1:]]))
    why = f"{what or f'`{key}`'} is for {listed or 'no method'}"
    if key == "damping" and method.damping_key is not None:
        why += f" (damp {method.name} with `{method.damping_key}`)"
    return why


def help_table(job: Command, indent: int = 2, width: int = 19) -> str:
    """The ``methods:`` lines of a command's help: each name and its summary."""
    lines = []
    for m in methods(job):
        first, *rest = m.summary.splitlines()
        lines.append(f"{' ' * indent}{m.name:<{width}}{first}")
        lines += [f"{' ' * (indent + width)}{line}" for line in rest]
    return "\n".join(lines)


def docs_list(job: Command) -> str:
    """The methods of ``job`` as docs/config.md lists them: one Markdown line each, from the
    records' ``docs``."""
    return "".join(f"- `{m.name}`: {m.docs}\n" for m in methods(job))
