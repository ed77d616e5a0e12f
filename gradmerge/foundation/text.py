"""Text for messages and settings: lists of names shortened, byte counts in words and read back.

In the foundation because the error messages of params, curvature, io, jobs and distributed
all shorten their lists of names with it, because ``gradmerge merge --dry-run`` and the
progress lines (:mod:`gradmerge.jobs.progress`) both state byte counts (:func:`byte_size`),
and because the YAML reader (``max_shard_size``) and ``gradmerge materialize --max-shard-size``
both read sizes such as ``5GB`` (:func:`parse_size`). It imports no torch, so a command's
``--help`` that reads sizes stays torch-free.

Example:
    >>> from gradmerge.foundation.text import byte_size, first_and_more, key_list
    >>> key_list(["a", "b", "c", "d"], limit=2)
    "['a', 'b', ... (2 more)]"
    >>> first_and_more(["w", "b"], "tensor(s)")
    "'w' and 1 more tensor(s)"
    >>> byte_size(999), byte_size(1000), byte_size(1.5e9)
    ('999 B', '1.0 kB', '1.5 GB')
    >>> parse_size("1.5GB"), parse_size("2KiB"), parse_size(100)
    (1500000000, 2048, 100)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from gradmerge.foundation.settings import shown


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


SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
"""The units :func:`parse_size` reads, upper-cased: decimal, and binary below."""
SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*")


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as ``"5GB"``, ``"500MB"``, ``"2GiB"`` (decimal/binary,
    any case): the number times the unit, rounded down, above 0.

    The number is unsigned digits with at most one dot (``1.5``, ``.5``; no sign, exponent or
    ``nan``/``inf``); a fraction of a byte is dropped (``"1.5B"`` is 1).

    Raises:
        TypeError: neither an int nor a string (a bool, a float, ``None``).
        ValueError: a string of another form or unit, a number too large for a float (``9``
            written 400 times), or a size that is not positive (``"0"``, ``"0.4"``, ``-1``).

    Example:
        >>> parse_size("1.5GB"), parse_size("2KiB"), parse_size(" 3 mb "), parse_size(7)
        (1500000000, 2048, 3000000, 7)
        >>> parse_size("1.5XB")
        Traceback (most recent call last):
        ...
        ValueError: expected a size such as '5GB', '500MB' or '2GiB', got '1.5XB'
    """
    if isinstance(value, bool):
        raise TypeError(f"expected a size in bytes or a string such as '5GB', got {shown(value)}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = _SIZE.fullmatch(value)
        unit = SIZE_UNITS.get(match.group(2).upper()) if match else None
        number = float(match.group(1)) * unit if match and unit else math.inf
        if not math.isfinite(number):  # no match, an unknown unit, or beyond a float
            raise ValueError(
                f"expected a size such as '5GB', '500MB' or '2GiB', got {shown(value)}"
            )
        size = int(number)
    else:
        raise TypeError(f"expected a size in bytes or a string such as '5GB', got {shown(value)}")
    if size <= 0:
        raise ValueError(f"a size must be positive, got {shown(value)}")
    return size
