"""The solvers: one frozen settings object per algorithm, passed to the call that solves.

In the shape of lineax (Rader et al.): a solver object holds only its own algorithm's settings
and is handed to the solve itself — ``C.solve_info(v, solver)``, or a rule's ``solver=``
(:func:`gradmerge.gradient_matching`, :func:`gradmerge.remove`,
:func:`gradmerge.influence_remove`); no operator carries settings of its own. Every solve
returns one :class:`gradmerge.Solution` whose ``result`` (:class:`gradmerge.solvers.solution.
Result`) says how it ended.

- :class:`CG`: conjugate gradients over parameter dicts — lazy sums of structures
  (:class:`gradmerge.Sum`) and matrix-free operators (:class:`gradmerge.MatrixFree`); settings
  ``tol``, ``maxiter``.
- :class:`KroneckerCG`: the K-FAC layers' solve, δ·I plus Kronecker products, by CG in the
  eigenbasis of the collapsed factors, certified in float64
  (:func:`gradmerge.solvers.kfac_cg.solve`); it adds ``approximate``, ``arithmetic`` and
  ``warm_start``. A :class:`KroneckerCG` is a :class:`CG`: where the system it meets is a
  sum or matrix-free, it runs plain CG with its ``tol`` and ``maxiter``.

Direct solves (δ·I, diagonal, dense, one or two Kronecker products without δ·I) take no
settings: they run whatever solver is passed. The YAML ``solver:`` block of a merge or removal
config maps onto a :class:`KroneckerCG` key for key (the solves of a job are K-FAC's), which the
streaming engine hands to every unit's solve. ``SolverSpec``, the one settings record that
came before these objects, is :class:`KroneckerCG` under its old name (a thin alias).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from gradmerge.errors import ArgumentError, RemovedArgumentError
from gradmerge.foundation.settings import check, declared, setting

ArithmeticMode = Literal["auto", "working", "bfloat16"]
"""The floating-point arithmetic of the K-FAC solves (the ``arithmetic`` setting): ``"working"``,
the operator's dtype throughout; ``"bfloat16"``, bfloat16 Kronecker products inside a
working-dtype refinement; ``"auto"``, bfloat16 where the device's bfloat16 products are measurably
faster. "Precision" names precision MATRICES only (the prior H_0, the merged H̄)."""
ARITHMETIC_MODES: tuple[ArithmeticMode, ...] = ("auto", "working", "bfloat16")
MAXITER = 1000
"""The default budget of CG iterations per round (``maxiter``), without ``approximate``."""
DEFAULT_TOL: dict[str, float] = {"float64": 1e-10, "float32": 1e-5}
"""The default relative residual of a solve (``tol=None``), by the dtype it runs in: a true
residual cannot fall much below κ·eps of the working precision
(:func:`gradmerge.solvers.cg.default_tol`)."""
LOW_PRECISION_TOL = 1e-2
"""The default relative residual of a solve in a 16-bit dtype."""


def number_text(value: float) -> str:
    """``value`` as the docs write it: ``1e-6`` (not ``1e-06``), ``0.5``, ``2000``.

    Example:
        >>> number_text(1e-6), number_text(2.5e-12), number_text(0.25), number_text(2000)
        ('1e-6', '2.5e-12', '0.25', '2000')
    """
    text = f"{value:g}"
    mantissa, e, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}" if e else text


def default_tol_text() -> str:
    """The default ``tol`` in words, from :data:`DEFAULT_TOL` (docs and docstrings say
    "default: see :data:`DEFAULT_TOL`" instead of restating it)."""
    return (
        f"{number_text(DEFAULT_TOL['float32'])} in float32, "
        f"{number_text(DEFAULT_TOL['float64'])} in float64 (the solve's dtype)"
    )


RENAMED = {"precision": "arithmetic"}
"""Fields of gradmerge 0.1.0 → their name now (Python keyword and YAML key alike): "precision"
means the prior's precision matrix in gradmerge, so the float arithmetic has its own name."""


@dataclass(frozen=True)
class Solver:
    """A solver: the settings of one algorithm for K x = b, passed to the call that solves.

    The subclasses are the algorithms (:class:`CG`, :class:`KroneckerCG`); an operator runs
    the one it is given where it applies (:meth:`gradmerge.Curvature.solve_info`) and refuses
    one that does not fit its structure with an :class:`~gradmerge.errors.ArgumentError`.
    """


@dataclass(frozen=True)
class CG(Solver):
    """Conjugate gradients on K x = b over parameter dicts, to a relative residual.

    The solve of a lazy sum of structures (:class:`gradmerge.Sum`) and of a matrix-free
    operator (:class:`gradmerge.MatrixFree`): unpreconditioned CG restarted from the true
    residual, stopping when ‖b − Kx‖/‖b‖ ≤ ``tol``; above it after ``maxiter`` iterations
    it raises :class:`~gradmerge.errors.NotConvergedError` (never a silent wrong result).

    - ``tol``: the relative residual ‖b − Kx‖/‖b‖ to reach; ``None``: by the solve's dtype,
      :data:`DEFAULT_TOL` (:func:`gradmerge.solvers.cg.default_tol`).
    - ``maxiter``: the iteration budget; ``None``: :data:`MAXITER` (the record holds the
      resolved number).

    Example:
        >>> import torch, gradmerge as gm
        >>> K = gm.KFAC({"fc": (torch.eye(2), torch.eye(1))})
        >>> S = K + gm.Diagonal({"fc.weight": torch.tensor([[1.0, 3.0]])})   # a Sum
        >>> s = S.solve_info({"fc.weight": torch.tensor([[2.0, 4.0]])}, gm.CG(tol=1e-6, maxiter=50))
        >>> s.result, s.value["fc.weight"].round(decimals=4)
        (<Result.successful: 'successful'>, tensor([[1., 1.]]))
    """

    tol: float | None = setting(
        None,
        "the relative residual to which every K-FAC layer's solve is certified, in float64.",
        what="a relative residual",
        above=0.0,
        below=1.0,
        example="e.g. 1.0e-6",
        default_doc=default_tol_text(),
        source="`gradmerge.solvers.cg.default_tol`: a true residual cannot fall much below "
        "κ·eps of the working precision",
    )
    maxiter: int | None = setting(
        None,
        "CG iterations per round: a whole number ≥ 1 (≥ 0 with `approximate: true`).",
        kind="integer",
        minimum=0,
        default_doc=f"{MAXITER} (0 with `approximate: true`)",
        source="`gradmerge.solvers.spec.MAXITER`, a budget; with `approximate`, 0: the "
        "preconditioner's solve alone",
    )

    def __post_init__(self) -> None:
        values = checked(
            {k: getattr(self, k) for k in declared(self)}, type(self).__name__, ArgumentError, self
        )
        for name, value in values.items():
            object.__setattr__(self, name, value)


@dataclass(frozen=True)
class KroneckerCG(CG):
    """The K-FAC layers' solve: δ·I plus Kronecker products, by eigenbasis-preconditioned CG.

    Each layer's system (δI + Σ_k A_k ⊗ G_k) X = B is solved by CG in the eigenbasis of the
    collapsed factors, preconditioned by the exact diagonal there, with iterative refinement
    until the relative residual, certified in float64, is at most ``tol``
    (:func:`gradmerge.solvers.kfac_cg.solve`). On a sum or a matrix-free operator it is a
    :class:`CG` with its ``tol`` and ``maxiter``. The settings of the iterative solves of a
    merge or removal (the YAML ``solver:`` block, key for key).

    Every field is declared once (its meaning, range and default:
    :func:`gradmerge.foundation.settings.declared`; docs/config.md's ``solver`` table is generated
    from them):

    - ``tol``: the relative residual ‖b − Kx‖/‖b‖ every solve must reach, certified in float64;
      ``None``: by the solve's dtype, :data:`DEFAULT_TOL`
      (:func:`gradmerge.solvers.cg.default_tol`).
    - ``maxiter``: CG iterations per round before :class:`NotConvergedError`; ``None``:
      :data:`MAXITER`, or 0 with ``approximate``; the record holds the resolved number.
    - ``approximate``: accept each K-FAC layer's solve after at most ``maxiter`` CG iterations
      with whatever residual it has, still measured and reported; never the default.
    - ``arithmetic``: the dtype of the K-FAC CG's inner Kronecker products: ``"working"``,
      ``"bfloat16"`` (inside an iterative refinement certified the same way) or ``"auto"``:
      ``"bfloat16"`` for float32 layers with both sides ≥
      :data:`gradmerge.solvers.kfac_cg.LOW_MIN_SIDE` on a device whose bfloat16 GEMMs are
      measurably faster (a CUDA device that supports bfloat16; a CPU where a timed 512²
      product is ≥ 1.5× faster in bfloat16), else ``"working"``.
    - ``warm_start``: start each K-FAC layer's CG from the best of the caller's guess (the
      task-arithmetic solution for a merge) and the preconditioner's solve, by their residuals.

    Example:
        >>> import torch, gradmerge as gm
        >>> gm.KroneckerCG(tol=1e-4, maxiter=200)
        KroneckerCG(tol=0.0001, maxiter=200, approximate=False, arithmetic='auto', warm_start=False)
        >>> gm.KroneckerCG().maxiter, gm.KroneckerCG(approximate=True).maxiter
        (1000, 0)
        >>> K = gm.KFAC({"fc": (torch.diag(torch.tensor([1.0, 3.0])), 2 * torch.eye(2))})
        >>> s = (K + 2.0).solve_info({"fc.weight": torch.ones(2, 2)}, gm.KroneckerCG(tol=1e-6))
        >>> s.result, s.value["fc.weight"][0]
        (<Result.successful: 'successful'>, tensor([0.2500, 0.1250]))
        >>> gm.KroneckerCG(tol=2.0)
        Traceback (most recent call last):
        ...
        gradmerge.errors.ArgumentError: `KroneckerCG.tol` (a relative residual) must be > 0 and < 1, got 2.0 (e.g. 1.0e-6)

    The field ``precision`` of gradmerge 0.1.0 is ``arithmetic`` (:data:`RENAMED`); the old
    keyword raises :class:`~gradmerge.errors.RemovedArgumentError` naming it. ``gm.SolverSpec``
    is this class under its former name.
    """

    approximate: bool = setting(
        False,
        "`true` (never the default) accepts each layer after at most `maxiter` CG iterations "
        "(0: the eigenbasis preconditioner's solve alone) with its measured float64 residual, "
        "instead of failing; the record marks those layers `success: false` and the command "
        "says how many stopped above `tol`.",
        kind="flag",
    )
    arithmetic: ArithmeticMode = setting(
        "auto",
        "`bfloat16` runs the CG's Kronecker products in bfloat16 (AMX, `avx512_bf16`, tensor "
        "cores) inside a refinement whose residual is formed in the working dtype; the float64 "
        "certificate and `tol` are the same. `working`: the products in the factors' dtype. "
        "`auto`: `bfloat16` for float32 layers with both sides ≥ 256 where a timed bfloat16 "
        "GEMM is ≥ 1.5× faster than float32 (once per process; on CUDA: bfloat16 support), "
        "else `working` — on GPT-2-124M's layers, 2 CPU cores with AMX: each product 4.5–5.7× "
        "faster, each layer's solve 1.3–1.4× (more iterations), same certificate "
        '(benchmarks/README.md, "Solver choices").',
        kind="choice",
        choices=ARITHMETIC_MODES,
    )
    warm_start: bool = setting(
        False,
        "`true`: start each K-FAC layer's CG from the task-arithmetic solution where its "
        "residual is smaller than the preconditioner's solve (one more product per layer; not "
        "the default until measured to pay on real fine-tunes); `false`: from the "
        "preconditioner's solve.",
        kind="flag",
    )

    def __new__(cls, *args: Any, **kwargs: Any) -> KroneckerCG:
        """Refuse the keywords of :data:`RENAMED` (the dataclass's ``__init__`` takes the rest)."""
        refuse_renamed(kwargs, cls.__name__, RemovedArgumentError)
        return super().__new__(cls)


SolverSpec = KroneckerCG
"""The former name of :class:`KroneckerCG` (same fields, same YAML keys): a thin alias."""


def refuse_renamed(
    given: Mapping[str, Any], where: str = "KroneckerCG", error: type[Exception] = ArgumentError
) -> None:
    """Raise ``error`` for a key of ``given`` that :data:`RENAMED` lists, naming its new name
    (``where``: a class name, a keyword; the YAML reader's ``solver``, a key)."""
    keyword = where in ("KroneckerCG", "SolverSpec")
    for old, new in RENAMED.items():
        if old in given:
            said = (
                f"{where}({old}=...) is {where}({new}=...)"
                if keyword
                else f"`{where}.{old}` is `{where}.{new}`"
            )
            raise error(
                f"{said} (renamed after gradmerge 0.1.0): the floating-point arithmetic of the "
                f'K-FAC solves ({", ".join(ARITHMETIC_MODES)}); "precision" names the prior\'s '
                f"precision matrix only. Rename the {'keyword' if keyword else 'key'}: "
                f"{new}={given[old]!r}"
            )


def checked(
    given: Mapping[str, Any],
    where: str = "KroneckerCG",
    error: type[Exception] = ArgumentError,
    solver: Any = None,
) -> dict[str, Any]:
    """The fields of ``solver`` (a solver class or instance; default :class:`KroneckerCG`) in
    ``given`` checked by their declarations, ``maxiter`` resolved; messages name each as
    ``{where}.{key}`` (the YAML reader: ``solver.tol``)."""
    settings = declared(KroneckerCG if solver is None else solver)
    out = {
        k: v
        if v is None and k in ("tol", "maxiter")
        else check(settings[k], v, f"{where}.{k}", error)
        for k, v in given.items()
    }
    approximate = out.get("approximate", False)
    if out.get("maxiter") is None:
        out["maxiter"] = 0 if approximate else MAXITER
    if out["maxiter"] == 0 and not approximate:
        clause = " (≥ 0 with approximate: true)" if "approximate" in settings else ""
        raise error(f"`{where}.maxiter` must be a whole number ≥ 1{clause}, got 0")
    return out


_S = TypeVar("_S", bound=Solver)


def solver_for(given: object, kind: type[_S], where: str) -> _S:
    """``given`` where it is a ``kind`` (``None``: ``kind()``, its defaults); else an
    :class:`~gradmerge.errors.ArgumentError` naming the solver ``where`` (the structure being
    solved) takes.

    Example:
        >>> solver_for(None, CG, "a Sum").maxiter
        1000
        >>> solver_for(CG(tol=1e-6), KroneckerCG, "KFAC")
        Traceback (most recent call last):
        ...
        gradmerge.errors.ArgumentError: KFAC solves with a gm.KroneckerCG, got CG(tol=1e-06, maxiter=1000): pass e.g. gm.KroneckerCG(tol=1e-06, maxiter=1000)
    """
    if given is None:
        return kind()
    if isinstance(given, kind):
        return given
    hint = (
        f"gm.{kind.__name__}(tol={given.tol!r}, maxiter={given.maxiter!r})"
        if isinstance(given, CG) and issubclass(kind, CG)
        else f"gm.{kind.__name__}(...)"
    )
    raise ArgumentError(
        f"{where} solves with a gm.{kind.__name__}, got {given!r}: pass e.g. {hint}"
        if isinstance(given, Solver)
        else f"{where} takes a solver object (gm.CG, gm.KroneckerCG), got "
        f"{type(given).__name__}: pass e.g. {hint}"
    )


def refuse_settings(where: str, given: Mapping[str, object]) -> None:
    """Refuse the solver keywords ``tol``/``maxiter`` that the operator ``where`` (``Sum``,
    ``MatrixFree``) took before the solver objects, naming the call that takes them now; any
    other unknown keyword is Python's ``TypeError``.

    Example:
        >>> refuse_settings("Sum", {"maxiter": 5})
        Traceback (most recent call last):
        ...
        gradmerge.errors.RemovedArgumentError: Sum no longer takes maxiter: an operator holds no solver settings; pass gm.CG(maxiter=5) to the call that solves, C.solve_info(v, gm.CG(maxiter=5)) or the rule's solver=gm.CG(maxiter=5)
    """
    for name in given:
        if name not in ("tol", "maxiter"):
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")
    if given:
        cg = "gm.CG(" + ", ".join(f"{k}={v!r}" for k, v in given.items()) + ")"
        raise RemovedArgumentError(
            f"{where} no longer takes {', '.join(given)}: an operator holds no solver settings; "
            f"pass {cg} to the call that solves, C.solve_info(v, {cg}) or the rule's "
            f"solver={cg}"
        )
