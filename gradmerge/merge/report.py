"""The one way to a solving rule's report: :func:`with_solution`.

The rules that solve a linear system (:func:`~gradmerge.merge.matching.gradient_matching`,
:func:`~gradmerge.merge.removal.remove`, :func:`~gradmerge.merge.removal.influence_remove`)
return parameters; :func:`with_solution` runs one of them and returns a
:class:`~gradmerge.merge.matching.Merged`: the same parameters with the :class:`gradmerge.Solution`
of its solve. No flag changes what a rule returns and no report travels through global state.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import ParamSpec, cast

from torch import Tensor

from gradmerge.errors import ArgumentError
from gradmerge.merge.inputs import refuse_removed
from gradmerge.merge.matching import Merged, _gradient_matching, gradient_matching
from gradmerge.merge.removal import _influence_remove, _remove, influence_remove, remove

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
        >>> out.params["fc.weight"][0], out.solution.parts["fc"].method, out.solution.success
        (tensor([1., 1.]), '1-term eigendecomposition', True)
    """
    solve = _SOLVING.get(cast(Callable[..., object], rule))
    if solve is None:
        name = getattr(rule, "__qualname__", repr(rule))
        raise ArgumentError(
            f"with_solution takes gm.gradient_matching, gm.remove or gm.influence_remove (the "
            f"rules that solve a linear system), got {name}: call it directly, it solves "
            "nothing to report"
        )
    bound = inspect.signature(rule).bind(*args, **kwargs)  # TypeError as the rule would raise
    bound.apply_defaults()
    arguments = dict(bound.arguments)  # the implementation's parameters, by the same names
    refuse_removed(getattr(rule, "__name__", ""), arguments.pop("removed"))
    return solve(**arguments)


_SOLVING: dict[Callable[..., object], Callable[..., Merged]] = {
    gradient_matching: _gradient_matching,
    remove: _remove,
    influence_remove: _influence_remove,
}
"""Each rule that solves a system → its implementation with the report (:func:`with_solution`)."""
