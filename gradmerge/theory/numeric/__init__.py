"""Numeric checks of the appendix on exact linear and logistic models (float64).

``ALL_CHECKS`` lists every :class:`~gradmerge.theory.numeric._common.NumericCheck`; each calls the
public gradmerge functions where the statement is about a merge or removal rule.
"""

from gradmerge.theory.numeric._common import NumericCheck
from gradmerge.theory.numeric.linear_checks import CHECKS as LINEAR_CHECKS
from gradmerge.theory.numeric.logistic_checks import CHECKS as LOGISTIC_CHECKS

ALL_CHECKS: list[NumericCheck] = [*LINEAR_CHECKS, *LOGISTIC_CHECKS]

__all__ = ["ALL_CHECKS", "LINEAR_CHECKS", "LOGISTIC_CHECKS", "NumericCheck"]
