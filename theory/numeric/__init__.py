"""Numeric checks of the appendix on exact linear and logistic models (float64).

``ALL_CHECKS`` lists every :class:`~theory.numeric._common.NumericCheck`; each calls the public
gradmerge functions where the statement is about a merge or removal rule.
"""

from theory.numeric._common import NumericCheck
from theory.numeric.linear_checks import CHECKS as LINEAR_CHECKS
from theory.numeric.logistic_checks import CHECKS as LOGISTIC_CHECKS

ALL_CHECKS: list[NumericCheck] = [*LINEAR_CHECKS, *LOGISTIC_CHECKS]

__all__ = ["ALL_CHECKS", "LINEAR_CHECKS", "LOGISTIC_CHECKS", "NumericCheck"]
