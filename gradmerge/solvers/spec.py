"""How an iterative solve K x = b is to be run: one frozen record, passed to each solve.

The YAML ``solver:`` block of a merge or removal config maps onto it key for key; the
streaming engine builds one per job and hands it to every unit's solve (no setting travels on
the operators). The in-memory rules take it as ``solver=``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gradmerge.errors import ArgumentError, RemovedArgumentError
from gradmerge.settings import check, declared, setting

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
class SolverSpec:
    """Settings of the iterative (K-FAC, CG) solves of a merge or removal.

    Every field is declared once (its meaning, range and default: :func:`gradmerge.settings.
    declared`; docs/config.md's ``solver`` table is generated from them):

    - ``tol``: the relative residual ‖b − Kx‖/‖b‖ every solve must reach, certified in float64;
      ``None``: by the solve's dtype, :data:`DEFAULT_TOL` (:func:`gradmerge.solvers.cg.default_tol`).
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
        >>> import gradmerge as gm
        >>> gm.SolverSpec(tol=1e-4, maxiter=200)
        SolverSpec(tol=0.0001, maxiter=200, approximate=False, arithmetic='auto', warm_start=False)
        >>> gm.SolverSpec().maxiter, gm.SolverSpec(approximate=True).maxiter
        (1000, 0)
        >>> gm.SolverSpec(tol=2.0)
        Traceback (most recent call last):
        ...
        gradmerge.errors.ArgumentError: `SolverSpec.tol` (a relative residual) must be > 0 and < 1, got 2.0 (e.g. 1.0e-6)

    The field ``precision`` of gradmerge 0.1.0 is ``arithmetic`` (:data:`RENAMED`); the old
    keyword raises :class:`~gradmerge.errors.RemovedArgumentError` naming it.
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

    def __new__(cls, *args: Any, **kwargs: Any) -> SolverSpec:
        """Refuse the keywords of :data:`RENAMED` (the dataclass's ``__init__`` takes the rest)."""
        refuse_renamed(kwargs, "SolverSpec", RemovedArgumentError)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        values = checked({k: getattr(self, k) for k in declared(self)}, "SolverSpec", ArgumentError)
        for name, value in values.items():
            object.__setattr__(self, name, value)


def refuse_renamed(
    given: Mapping[str, Any], where: str = "SolverSpec", error: type[Exception] = ArgumentError
) -> None:
    """Raise ``error`` for a key of ``given`` that :data:`RENAMED` lists, naming its new name
    (``where``: ``SolverSpec``, a keyword; the YAML reader's ``solver``, a key)."""
    for old, new in RENAMED.items():
        if old in given:
            said = (
                f"SolverSpec({old}=...) is SolverSpec({new}=...)"
                if where == "SolverSpec"
                else f"`{where}.{old}` is `{where}.{new}`"
            )
            raise error(
                f"{said} (renamed after gradmerge 0.1.0): the floating-point arithmetic of the "
                f'K-FAC solves ({", ".join(ARITHMETIC_MODES)}); "precision" names the prior\'s '
                f"precision matrix only. Rename the {'keyword' if where == 'SolverSpec' else 'key'}: "
                f"{new}={given[old]!r}"
            )


def checked(
    given: Mapping[str, Any], where: str = "SolverSpec", error: type[Exception] = ArgumentError
) -> dict[str, Any]:
    """The :class:`SolverSpec` fields in ``given`` checked by their declarations, ``maxiter``
    resolved; messages name each as ``{where}.{key}`` (the YAML reader: ``solver.tol``)."""
    settings = declared(SolverSpec)
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
        raise error(
            f"`{where}.maxiter` must be a whole number ≥ 1 (≥ 0 with approximate: true), got 0"
        )
    return out
