"""Shared helpers for the symbolic proofs of the appendix.

Everything here works on :class:`sympy.Matrix` objects with *generic* symbolic entries. A claim
``A == B`` is decided by :func:`decide` on the residual ``A - B``:

* it returns ``True`` when every entry of the residual cancels to ``0`` (``sympy.cancel`` brings a
  rational function to the canonical form ``p/q`` with ``p``, ``q`` coprime and expanded, so ``0``
  there means the residual is identically zero);
* it returns ``False`` only after exhibiting a *rational counterexample*: a point with rational
  coordinates at which the residual is finite and nonzero, evaluated in exact arithmetic. This is a
  rigorous disproof of the identity. The point need not lie in the "valid" region (e.g. positive
  definite ``H_0``, positive weights): a rational function that is nonzero at one point is nonzero
  on a dense open set, so it is nonzero somewhere in every nonempty open region of parameters;
* if neither happens it raises :class:`Undecided` rather than guessing.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

import sympy as sp

__all__ = [
    "Undecided",
    "as_matrix",
    "counterexample",
    "decide",
    "gaussian_logpdf",
    "grad",
    "hessian",
    "inv",
    "is_identically_zero",
    "mat",
    "same_shape",
    "sym",
    "vec",
]


class Undecided(RuntimeError):
    """The residual neither cancelled to zero nor produced a rational counterexample."""


def vec(name: str, d: int = 2) -> sp.Matrix:
    """Column vector ``[name_1, ..., name_d]`` of real symbols."""
    return sp.Matrix([sp.Symbol(f"{name}_{i + 1}", real=True) for i in range(d)])


def mat(name: str, n: int, m: int) -> sp.Matrix:
    """Generic ``n x m`` matrix of real symbols ``name_ij``."""
    return sp.Matrix(n, m, lambda i, j: sp.Symbol(f"{name}_{i + 1}{j + 1}", real=True))


def sym(name: str, d: int = 2) -> sp.Matrix:
    """Generic symmetric ``d x d`` matrix: entry ``(i, j)`` and ``(j, i)`` share one symbol."""
    return sp.Matrix(
        d, d, lambda i, j: sp.Symbol(f"{name}_{min(i, j) + 1}{max(i, j) + 1}", real=True)
    )


def inv(a: sp.Matrix) -> sp.Matrix:
    """Inverse as adjugate / determinant (compact and fast for the small sizes used here)."""
    return a.adjugate() / a.det()


def grad(f: sp.Expr, theta: sp.Matrix) -> sp.Matrix:
    """Gradient of a scalar expression with respect to the symbols of the vector ``theta``."""
    return sp.Matrix([sp.diff(f, x) for x in theta])


def hessian(f: sp.Expr, theta: sp.Matrix) -> sp.Matrix:
    """Hessian of a scalar expression with respect to the symbols of ``theta``."""
    return sp.hessian(f, list(theta))


def gaussian_logpdf(theta: sp.Matrix, mean: sp.Matrix, precision: sp.Matrix) -> sp.Expr:
    """``log N(theta | mean, precision^{-1})`` including its normalising constant."""
    d = theta.shape[0]
    r = theta - mean
    quad = (r.T * precision * r)[0, 0]
    return -quad / 2 + sp.log(precision.det()) / 2 - sp.Rational(d, 2) * sp.log(2 * sp.pi)


def lsq_loss(x: sp.Matrix, y: sp.Matrix, theta: sp.Matrix) -> sp.Expr:
    """Linear-regression loss ``½‖y − Xθ‖²``."""
    r = y - x * theta
    return (r.T * r)[0, 0] / 2


def sqnorm(v: sp.Matrix, weight: sp.Matrix | None = None) -> sp.Expr:
    """``‖v‖²`` or ``‖v‖²_W = vᵀ W v``."""
    return (v.T * v)[0, 0] if weight is None else (v.T * weight * v)[0, 0]


def at(expr: sp.Matrix | sp.Expr, theta: sp.Matrix, value: sp.Matrix) -> sp.Matrix | sp.Expr:
    """Substitute the vector ``value`` for the symbols of ``theta`` (simultaneously)."""
    return expr.subs(dict(zip(theta, value, strict=True)), simultaneous=True)


def msum(terms: Iterable[sp.Matrix], shape: tuple[int, int]) -> sp.Matrix:
    """Sum of matrices (``sum`` with a zero matrix of the given shape as start)."""
    total = sp.zeros(*shape)
    for term in terms:
        total += term
    return total


def as_matrix(x: sp.Matrix | sp.Expr) -> sp.Matrix:
    """Wrap a scalar as a ``1 x 1`` matrix; pass matrices through."""
    return x if isinstance(x, sp.MatrixBase) else sp.Matrix([[x]])


def same_shape(a: sp.Matrix | sp.Expr, b: sp.Matrix | sp.Expr) -> bool:
    """Whether ``a - b`` is defined (conformable shapes)."""
    return as_matrix(a).shape == as_matrix(b).shape


def is_identically_zero(x: sp.Matrix | sp.Expr) -> bool:
    """True iff every entry cancels to exactly ``0``.

    ``sympy.cancel`` returns the canonical form ``p/q`` of a rational function (``p``, ``q``
    expanded and coprime), so the result is ``0`` exactly when the entry is identically zero.
    """
    return all(sp.cancel(e) == 0 for e in as_matrix(x))


def _rational(rng: random.Random) -> sp.Rational:
    num = rng.choice([n for n in range(-7, 8) if n != 0])
    return sp.Rational(num, rng.randint(1, 5))


def counterexample(
    x: sp.Matrix | sp.Expr,
    *,
    seed: int = 0,
    tries: int = 25,
    fixed: dict[sp.Symbol, sp.Expr] | None = None,
) -> dict[sp.Symbol, sp.Expr] | None:
    """A rational point at which some entry of ``x`` is finite and nonzero, or ``None``.

    Symbols in ``fixed`` keep the given values (e.g. to stay in a positive-definite region); every
    other free symbol gets a pseudo-random small rational. Evaluation is exact.
    """
    m = as_matrix(x)
    free: list[sp.Symbol] = sorted(m.free_symbols, key=lambda s: s.name)
    rng = random.Random(seed)
    for _ in range(tries):
        point: dict[sp.Symbol, sp.Expr] = {s: _rational(rng) for s in free}
        if fixed:
            point.update(fixed)
        for e in m:
            v = sp.cancel(e.subs(point))
            # accept only a certified nonzero finite number (exact rationals in practice)
            if v.is_number and v.is_finite and v.is_zero is False:
                return point
    return None


def decide(x: sp.Matrix | sp.Expr, *, fixed: dict[sp.Symbol, sp.Expr] | None = None) -> bool:
    """Decide whether the residual ``x`` is identically zero (see the module docstring).

    A quick exact evaluation at a few rational points comes first (cheap disproof of a false
    identity), then the symbolic cancellation, then a longer search for a counterexample.
    """
    if counterexample(x, fixed=fixed, tries=2) is not None:
        return False
    if is_identically_zero(x):
        return True
    if counterexample(x, fixed=fixed, seed=1) is not None:
        return False
    if all(sp.simplify(e) == 0 for e in as_matrix(x)):  # slow path; not expected to be needed
        return True
    raise Undecided(f"residual neither cancels nor has a rational counterexample: {x}")


def decide_equal(a: sp.Matrix | sp.Expr, b: sp.Matrix | sp.Expr) -> bool:
    """``decide(a - b)``, and ``False`` when the shapes are not conformable."""
    if not same_shape(a, b):
        return False
    return decide(as_matrix(a) - as_matrix(b))


def all_hold(results: Iterable[bool]) -> bool:
    """Conjunction that evaluates every item (so each sub-claim is really decided)."""
    values: Sequence[bool] = list(results)
    return all(values)


__all__ += ["all_hold", "at", "decide_equal", "lsq_loss", "msum", "sqnorm"]


D = 2  # parameters in the generic symbolic setting
T = 2  # tasks


class MergeSymbols:
    """Generic symbols of the merge setting (d = 2, T = 2): symmetric H_0 and H_t, free θ_LLM
    and θ_t, and weights α_t. Modules subclass it to add what their result needs."""

    def __init__(self) -> None:
        self.h0 = sym("H0", D)
        self.h = [sym(f"H{t + 1}", D) for t in range(T)]
        self.thl = vec("thL", D)
        self.th = [vec(f"th{t + 1}", D) for t in range(T)]
        self.al = [sp.Symbol(f"alpha{t + 1}", real=True) for t in range(T)]
