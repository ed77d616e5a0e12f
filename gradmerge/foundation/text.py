"""Text for messages: lists of names shortened, and byte counts in words.

In the foundation because the error messages of params, curvature, io, jobs and distributed
all shorten their lists of names with it, and because ``gradmerge merge --dry-run`` and the
progress lines (:mod:`gradmerge.jobs.progress`) both state byte counts (:func:`byte_size`).
It imports no torch.

Example:
    >>> from gradmerge.foundation.text import byte_size, first_and_more, key_list
    >>> key_list(["a", "b", "c", "d"], limit=2)
    "['a', 'b', ... (2 more)]"
    >>> first_and_more(["w", "b"], "tensor(s)")
    "'w' and 1 more tensor(s)"
    >>> byte_size(999), byte_size(1000), byte_size(1.5e9)
    ('999 B', '1.0 kB', '1.5 GB')
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


BYTE_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
"""The decimal units :func:`byte_size` states a count in, largest first (1 kB = 1000 B)."""


def byte_size(nbytes: float) -> str:
    """``nbytes`` in the largest decimal unit it reaches, to one decimal (``"1.5 GB"``); below
    1 kB the whole number of bytes (``"999 B"``).

    The unit is chosen before rounding: 999,999 B is ``"1000.0 kB"``.

    Example:
        >>> byte_size(0), byte_size(999), byte_size(1000), byte_size(1e6), byte_size(1.5e9)
        ('0 B', '999 B', '1.0 kB', '1.0 MB', '1.5 GB')
    """
    for unit, scale in BYTE_UNITS:
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"
