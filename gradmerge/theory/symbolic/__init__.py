"""Symbolic (sympy) proofs of the appendix of Daheim et al., "Model Merging by Uncertainty-Based
Gradient Matching".

Each module proves one result group and exposes ``CHECKS``; ``expect=False`` marks a statement as
printed that is wrong (its check demonstrates the failure), usually next to its corrected form.

Modules, in paper order: :mod:`.mismatch` (Sec. 1.1), :mod:`.merge_rule` (Sec. 1.2),
:mod:`.removal` (Sec. 1.3), :mod:`.cook` and :mod:`.koh_liang` (Sec. 1.4), :mod:`.laplace_map`
(Sec. 1.5), :mod:`.bayes_map` (Sec. 1.6).
"""

from __future__ import annotations

from gradmerge.foundation.extras import require

require("testbed", "the theory testbed (gradmerge verify, gradmerge.theory.symbolic)")

from gradmerge.theory.symbolic import (  # noqa: E402 (after the check for sympy)
    bayes_map,
    cook,
    koh_liang,
    laplace_map,
    merge_rule,
    mismatch,
    removal,
)
from gradmerge.theory.symbolic._check import SymbolicCheck  # noqa: E402

__all__ = ["ALL_CHECKS", "SymbolicCheck", "run_all"]

ALL_CHECKS: list[SymbolicCheck] = [
    *mismatch.CHECKS,
    *merge_rule.CHECKS,
    *removal.CHECKS,
    *cook.CHECKS,
    *koh_liang.CHECKS,
    *laplace_map.CHECKS,
    *bayes_map.CHECKS,
]


def run_all() -> list[tuple[SymbolicCheck, bool]]:
    """Run every check in paper order; returns ``(check, result)`` pairs."""
    return [(check, check.run()) for check in ALL_CHECKS]
