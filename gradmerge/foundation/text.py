"""Lists of names, shortened for error messages.

In the foundation because the error messages of params, curvature, io, jobs and distributed
all shorten their lists of names with it.

Example:
    >>> from gradmerge.foundation.text import key_list, first_and_more
    >>> key_list(["a", "b", "c", "d"], limit=2)
    "['a', 'b', ... (2 more)]"
    >>> first_and_more(["w", "b"], "tensor(s)")
    "'w' and 1 more tensor(s)"
"""

from __future__ import annotations

from collections.abc import Sequence


def key_list(keys: Sequence[str], limit: int = 5) -> str:
    """The first ``limit`` names, quoted, in brackets, and how many are left out."""
    keys = list(keys)
    shown = ", ".join(repr(k) for k in keys[:limit])
    more = len(keys) - limit
    return f"[{shown}{f', ... ({more} more)' if more > 0 else ''}]"


def first_and_more(keys: Sequence[str], noun: str = "") -> str:
    """The first name, quoted, and ``and N more <noun>`` when there are others."""
    more = len(keys) - 1
    return f"{keys[0]!r}" + (f" and {more} more{f' {noun}' if noun else ''}" if more > 0 else "")
