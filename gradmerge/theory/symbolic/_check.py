"""The record every symbolic derivation check publishes.

A module in :mod:`gradmerge.theory.symbolic` proves one result of the appendix. It exposes
``CHECKS``, a list of :class:`SymbolicCheck`. ``expect=True`` marks a statement that must hold;
``expect=False`` marks a statement *as printed* in the appendix that is wrong (an erratum), whose
check must return ``False``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SymbolicCheck:
    """One symbolic statement and the function that decides it.

    Attributes:
        id: stable identifier, e.g. ``"eq2"``, ``"eq19-printed"``, ``"eq19-corrected"``.
        where: location in the appendix, e.g. ``"Eq. 2 (line 8)"``.
        statement: the statement in words/maths, short (one line).
        expect: ``True`` if the statement holds, ``False`` if it is a printed erratum.
        run: returns ``True`` iff the statement holds as an identity (residual simplifies to 0).
    """

    id: str
    where: str
    statement: str
    expect: bool
    run: Callable[[], bool]
