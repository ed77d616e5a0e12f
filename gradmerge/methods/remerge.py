"""``remerge``: the exact removal of tasks from a merge, the merge ``merge`` (its YAML) run again
without the models listed in ``without``.

It has no rule of its own: its configuration becomes that merge's (``runs="merge"``,
:func:`gradmerge.jobs.config.remerge_config`), which runs with its method's rule.

Example:
    >>> METHOD.command, METHOD.runs, METHOD.rule is None
    ('remove', 'merge', True)
"""

from __future__ import annotations

from gradmerge.methods.base import MergeMethod

METHOD = MergeMethod(
    "remerge",
    "remove",
    "the exact removal of tasks from a merge: the merge `merge` (its YAML) again\n"
    "without the models listed in `without`; runs as that merge",
    {"merge": "required", "without": "required"},
    None,
    docs="the merge `merge` (its YAML) run again without the models listed in `without`: the "
    "exact removal of those tasks from a merge (below).",
    runs="merge",
)
