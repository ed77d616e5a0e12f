"""The one way to a solving rule's report: :func:`with_solution`.

The rules that solve a linear system (:func:`~gradmerge.merge.matching.gradient_matching`,
:func:`~gradmerge.merge.removal.remove`, :func:`~gradmerge.merge.removal.influence_remove`)
return parameters; each declares, where it is defined, its implementation with the report
(:func:`gradmerge.merge.matching.reports`: the same parameters, returning a
:class:`~gradmerge.merge.matching.Merged`). :func:`with_solution` calls that implementation with
the caller's arguments as they are: the same parameters with the :class:`gradmerge.Solution`
of the solve. No flag changes what a rule returns, no report travels through global state, and
no list of rules lives here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec

from torch import Tensor

from gradmerge.errors import ArgumentError
from gradmerge.merge.matching import SOLUTION, Merged

_Rule = ParamSpec("_Rule")


def with_solution(
    rule: Callable[_Rule, dict[str, Tensor]], /, *args: _Rule.args, **kwargs: _Rule.kwargs
) -> Merged:
    r"""Run ``rule`` on these arguments and return its parameters with the report of its solve.

    ``rule`` is one of the rules that solve a linear system — :func:`gradient_matching` (Eq. 6:
    H̄ x = Σ_t α_t (H_0 + H_t) τ_t), :func:`remove` (Eq. 13) or :func:`influence_remove` — and
    the arguments are its own, checked as it checks them. The parameters are those the rule
    returns, bit for bit. The one way to a merge's report: where it matters most is an
    approximate solve (``solver=gm.KroneckerCG(approximate=True, maxiter=N)``), whose
    ``solution.result`` is ``Result.max_iterations_reached`` for a layer left above the
    tolerance.

    Raises:
        ArgumentError: ``rule`` is not one of the three (the others solve no system to report).

    Example:
        >>> import torch, gradmerge as gm
        >>> K = gm.KFAC({"fc": (torch.diag(torch.tensor([1.0, 3.0])), 2 * torch.eye(2))})
        >>> ft = {"fc.weight": torch.ones(2, 2)}
        >>> out = gm.with_solution(gm.gradient_matching, {"fc.weight": torch.zeros(2, 2)}, [ft], [K], prior=1.0)
        >>> out.params["fc.weight"][0], out.solution.parts["fc"].method, out.solution.result
        (tensor([1., 1.]), '1-term eigendecomposition', <Result.successful: 'successful'>)
    """
    solve: Callable[_Rule, Merged] | None = getattr(rule, SOLUTION, None)
    if solve is None:
        name = getattr(rule, "__qualname__", repr(rule))
        raise ArgumentError(
            f"with_solution takes gm.gradient_matching, gm.remove or gm.influence_remove (the "
            f"rules that solve a linear system), got {name}: call it directly, it solves "
            "nothing to report"
        )
    return solve(*args, **kwargs)
