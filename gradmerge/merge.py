"""Merge and removal rules, each written once against the :class:`Curvature` interface.

Notation (Daheim et al., ICLR 2024, appendix) → arguments:

==============================  ==================  =============================================
paper                           code                meaning
==============================  ==================  =============================================
θ_LLM                           ``base``            pretrained parameters
θ_t                             ``finetuned[t]``    parameters fine-tuned on task t
H_0                             ``prior``           prior precision around ``base`` (float δ: δ·I)
H_t                             ``curvatures[t]``   task t's curvature, a SUM over its examples
α_t                             ``alphas[t]``       task weights
H̄ = H_0 + Σ_t α_t H_t                               merged precision
H̄_\\t = δI + ∇²ℓ̄_\\t(θ_LLM)      ``remaining``       curvature of the data that stays (removal)
∇ℓ̄_t(θ_LLM)                     ``gradient``        gradient of the data to remove, at the base
==============================  ==================  =============================================

Task arithmetic (H_t = 0) and Fisher averaging (H_0 = 0) are the merge rule of Eq. 6 with those
inputs; they are implemented as exactly that, so every method shares one code path.

The functions are pure: parameter dicts and curvatures in, a new parameter dict out; no I/O, no
device moves. Inputs are validated (keys, shapes, dtypes, devices, finiteness, PSD curvatures);
errors are typed (:mod:`gradmerge.errors`).

The rules that solve a system (:func:`gradient_matching`, :func:`remove`,
:func:`influence_remove`) take the solver settings explicitly (``solver=``, a
:class:`gradmerge.SolverSpec`) and, like every rule, return the parameters; called through
:func:`with_solution` they return a :class:`Merged`, the parameters with the solve's report
(method, iterations, certified residual per block): the report travels with the result, not
through any global state or a flag that changes the return type.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NoReturn, ParamSpec, cast

import torch
from torch import Tensor

from gradmerge import params as P
from gradmerge.curvature import KFAC, Curvature, ScaledIdentity
from gradmerge.curvature.base import coarsest_dtype
from gradmerge.elementwise import matching as _elementwise
from gradmerge.elementwise import removal as _removal
from gradmerge.elementwise.matching import SELECTED, Kernel
from gradmerge.errors import PD_FIX, ArgumentError, NotPositiveDefiniteError, StructureError
from gradmerge.params import Params
from gradmerge.solvers.solution import Solution
from gradmerge.solvers.spec import SolverSpec

CurvatureLike = Curvature | float
"""A curvature operator, or a float δ meaning δ·I."""


@dataclass(frozen=True)
class Merged:
    """What a rule that solves a linear system returns through :func:`with_solution`.

    Attributes:
        params: the parameters the rule returns (merged, or with data removed).
        solution: the :class:`gradmerge.Solution` of its solve (H̄ x = rhs for Eq. 6, H̄_\\t x =
            rhs for removal): method, iterations, certified residual, success, per K-FAC layer
            in ``parts``; the elementwise paths solve exactly in the merge's own pass and report
            their method (and, for removal, what the pass measured) with an empty ``value``.
    """

    params: dict[str, Tensor]
    solution: Solution


def task_arithmetic(
    base: Params,
    finetuned: Sequence[Params],
    *,
    alphas: float | Sequence[float] = 1.0,
    kernel: Kernel | None = SELECTED,
) -> dict[str, Tensor]:
    r"""Task arithmetic: θ_TA = θ_LLM + Σ_t α_t (θ_t − θ_LLM)  (Eq. 2, first term).

    Implemented as Eq. 6 with H_t = 0 and H_0 = I, which reduces to this closed form exactly
    (``kernel``: as in :func:`gradient_matching`).

    Example:
        >>> import torch, gradmerge as gm
        >>> base = {"w": torch.zeros(2)}
        >>> gm.task_arithmetic(base, [{"w": torch.ones(2)}, {"w": 3 * torch.ones(2)}], alphas=0.5)
        {'w': tensor([2., 2.])}
    """
    if len(finetuned) == 0:
        raise ArgumentError(
            "task_arithmetic needs at least one fine-tuned model, got none: pass "
            "finetuned=[θ_1, ...]"
        )
    zero = ScaledIdentity(0.0)
    return gradient_matching(
        base, finetuned, [zero] * len(finetuned), prior=1.0, alphas=alphas, kernel=kernel
    )


def fisher_average(
    finetuned: Sequence[Params],
    curvatures: Sequence[Curvature],
    *,
    alphas: float | Sequence[float] = 1.0,
    kernel: Kernel | None = SELECTED,
) -> dict[str, Tensor]:
    r"""Fisher-weighted averaging: θ = (Σ_t α_t H_t)⁻¹ Σ_t α_t H_t θ_t  (Matena & Raffel, 2022).

    Implemented as Eq. 6 with H_0 = 0 (and θ_LLM = 0, on which the result then does not depend;
    ``kernel``: as in :func:`gradient_matching`).
    Σ_t α_t H_t must be positive definite; with diagonal Fishers that have zero entries, damp them
    (``curvature + 1e-8``) or use :func:`gradient_matching` with a small prior.

    Example:
        >>> import torch, gradmerge as gm
        >>> F1, F2 = gm.Diagonal({"w": torch.tensor([1.0])}), gm.Diagonal({"w": torch.tensor([3.0])})
        >>> gm.fisher_average([{"w": torch.tensor([0.0])}, {"w": torch.tensor([4.0])}], [F1, F2])
        {'w': tensor([3.])}
    """
    if len(finetuned) == 0:
        raise ArgumentError("fisher_average needs at least one fine-tuned model, got none")
    origin = P.zeros_like(finetuned[0])
    return gradient_matching(origin, finetuned, curvatures, prior=0.0, alphas=alphas, kernel=kernel)


REGMEAN_OFF_DIAGONAL = 0.1
"""Jin et al.'s off-diagonal factor r (their α; ``reduce_non_diag`` in their code), the one default
of :func:`regmean`, :func:`regmean_systems` and the YAML key ``off_diagonal``: the value of the
reference implementation's RegMean experiments (``regmean_reduce_nondiag: 0.1`` in its RoBERTa,
DeBERTa and T5 configurations; 0.9 in one DeBERTa NER configuration) and of FusionBench's RegMean
(``reduce_non_diagonal_ratio: 0.1``, version 0.2.33). r = 1 is the plain closed form."""


def regmean(
    finetuned: Sequence[Params],
    grams: Sequence[Mapping[str, Tensor]],
    *,
    alphas: float | Sequence[float] = 1.0,
    bias: Sequence[str] = (),
    transposed: Sequence[str] = (),
    off_diagonal: float = REGMEAN_OFF_DIAGONAL,
) -> dict[str, Tensor]:
    r"""RegMean (Jin et al., 2023): the K-FAC special case of the merge rule with G = I, H_0 = 0.

    For every linear layer m with input Gram matrices G_t = X_tᵀX_t (one per task; with the bias
    as the last input column for the layers in ``bias``)

    .. math::

        [W \mid b]^\star = \Big(\sum_t \alpha_t [W_t \mid b_t]\, G_t\Big)
            \Big(\sum_t \alpha_t G_t\Big)^{-1},

    and every other parameter is the α-weighted average Σ_t α_t θ_t / Σ_t α_t. Jin et al. scale
    the off-diagonal entries of every Gram by a factor r ∈ [0, 1] (their α; ``off_diagonal``;
    the reference code's ``reduce_non_diag``), i.e. each G_t is replaced by

    .. math::

        \tilde G_t = r\, G_t + (1 - r)\, \mathrm{diag}(G_t),

    which leaves the diagonal and shrinks the merge towards the per-input-weighted average:
    r = 1 is the plain closed form, r = 0 uses diag(G_t) only; the default is
    :data:`REGMEAN_OFF_DIAGONAL` (0.1, as the reference implementation's experiments). For r < 1,
    Σ_t α_t G̃_t ⪰ (1 − r) Σ_t α_t diag(G_t) is positive definite whenever every input has a
    nonzero mean square in some task (α_t > 0), so no damping is needed. Jin et al.'s code and
    FusionBench solve for the weights only and average the biases (and every parameter of a
    module that is not linear: embeddings, LayerNorms): leave ``bias`` empty for that; a module
    in ``bias`` solves [W | b] jointly, its Gram including the constant input column.
    Implemented as :func:`fisher_average` (Eq. 6 with H_0 = 0) with curvatures
    ``KFAC({m: (G_t, I)})`` per layer, so the sum Σ_t α_t G_t ⊗ I is formed exactly and solved
    in one eigendecomposition, and with H_t = I on the other parameters.

    Precision. Each layer's system is formed and solved in float64 whatever the dtype of the
    inputs (Grams are in × in: small), one layer at a time, and the result is returned in the
    dtype of ``finetuned``. What the Grams can resolve is judged at the precision they were
    GIVEN in: rounding each entry to a dtype of machine epsilon ε moves G_t by E_t with
    ‖E_t‖₂ ≤ ‖E_t‖_F ≤ (ε/2)‖G_t‖_F, so by Weyl's inequality every eigenvalue of
    S = Σ_t α_t G_t is known only up to τ = (ε/2) Σ_t |α_t| ‖G_t‖_F. If λ_min(S) > τ the system
    the Grams were rounded from is certainly positive definite and the solve goes ahead
    (relative error about κ(S)·ε in the result); otherwise :class:`NotPositiveDefiniteError`
    names EVERY layer where it fails, each with λ_min and τ, and suggests the damping δ (added
    to every G_t) that lifts the worst of them: S + δ·Σα_t·I must clear τ + (ε/2)·Σ|α_t|·δ·√n
    (the damped Grams' own rounding), so δ = 2·(τ − λ_min)/(Σα_t − (ε/2)·Σ|α_t|·√n), above
    every threshold printed (:func:`regmean_systems` gives these numbers without merging).

    Args:
        finetuned: θ_1, …, θ_T.
        grams: per task, module name → Gram matrix of that layer's inputs (the same modules for
            every task).
        alphas: α_t.
        bias: modules whose weight has a bias (their Grams include the constant input column).
        transposed: modules whose weight is stored (in, out) (GPT-2 ``Conv1D``).
        off_diagonal: r, the factor on the Grams' off-diagonal entries (default
            :data:`REGMEAN_OFF_DIAGONAL`, as ``gradmerge merge``; 1: the plain closed form).

    Raises:
        NotPositiveDefiniteError: Σ_t α_t G̃_t of some layers is singular at the Grams'
            precision (all of them named).
        StructureError: Grams for modules the models lack, or for different modules per task.
        ArgumentError: a wrong number of Gram sets or alphas.

    Example:
        >>> import torch, gradmerge as gm
        >>> fts = [{"fc.weight": torch.tensor([[1.0, 0.0]])}, {"fc.weight": torch.tensor([[0.0, 1.0]])}]
        >>> grams = [{"fc": torch.diag(torch.tensor([3.0, 1.0]))}, {"fc": torch.diag(torch.tensor([1.0, 3.0]))}]
        >>> gm.regmean(fts, grams)["fc.weight"]  # diagonal Grams: r does not matter
        tensor([[0.7500, 0.7500]])
    """
    if len(grams) != len(finetuned):
        raise ArgumentError(f"got {len(finetuned)} fine-tuned models but {len(grams)} Gram sets")
    if not finetuned:
        raise ArgumentError("regmean needs at least one fine-tuned model, got none")
    weights = _alphas(alphas, len(finetuned))
    for t, ft in enumerate(finetuned):
        P.check_params(ft, name=f"finetuned[{t}]")
        P.check_compatible(finetuned[0], ft, ref_name="finetuned[0]", name=f"finetuned[{t}]")
    layers = _regmean_layers(finetuned, grams)
    raise_unresolved(regmean_systems(grams, weights, off_diagonal=off_diagonal))
    merged: dict[str, Tensor] = {}
    for name in layers:  # one layer at a time: float64 copies of one layer's weights only
        layer = [_off_diagonal_scaled(g[name], off_diagonal) for g in grams]
        curvatures = [
            _regmean_curvature(name, g, ft, bias=bias, transposed=transposed)
            for g, ft in zip(layer, finetuned, strict=True)
        ]
        keys = [k for k, _ in curvatures[0].layout]
        missing = [k for k in keys if k not in finetuned[0]]
        if missing:
            raise StructureError(
                f"grams name {name!r} with a bias, but the models have no {missing[0]!r}: "
                f"leave {name!r} out of `bias`, or pass models with that parameter"
            )
        wide = [{k: ft[k].to(torch.float64) for k in keys} for ft in finetuned]
        solved = fisher_average(wide, curvatures, alphas=weights)
        merged.update({k: solved[k].to(finetuned[0][k].dtype) for k in keys})
    rest = [{k: v for k, v in ft.items() if k not in merged} for ft in finetuned]
    if rest[0]:  # H_t = I: the α-weighted average
        merged.update(fisher_average(rest, [ScaledIdentity(1.0)] * len(rest), alphas=weights))
    return {k: merged[k] for k in finetuned[0]}


def _regmean_layers(
    finetuned: Sequence[Params], grams: Sequence[Mapping[str, Tensor]]
) -> list[str]:
    """The modules RegMean solves for: those of ``grams[0]``, which every task must share."""
    layers = list(grams[0])
    for t, gram in enumerate(grams):
        for name, g in gram.items():
            if f"{name}.weight" not in finetuned[t]:
                raise StructureError(
                    f"grams[{t}] names {name!r}, but finetuned[{t}] has no {name}.weight"
                )
            if not isinstance(g, Tensor) or g.ndim != 2 or g.shape[0] != g.shape[1]:
                got = tuple(g.shape) if isinstance(g, Tensor) else type(g).__name__
                raise StructureError(
                    f"grams[{t}][{name!r}] must be a square Gram matrix (inputs × inputs), "
                    f"got {got}"
                )
        if set(gram) != set(layers):
            raise StructureError(
                f"grams[{t}] covers modules {sorted(gram)} but grams[0] covers {sorted(layers)}: "
                "pass a Gram for the same modules for every task"
            )
    return layers


def _regmean_curvature(
    name: str, gram: Tensor, ft: Params, *, bias: Sequence[str], transposed: Sequence[str]
) -> KFAC:
    """G_t ⊗ I for layer ``name`` in float64, built in the Gram's own dtype first so that the
    curvature remembers it (:attr:`Curvature.coarsest_dtype`: a float32 Gram's round-off
    eigenvalues are then judged at float32's precision by the PSD check)."""
    weight = ft[f"{name}.weight"]
    out = weight.shape[1] if name in transposed else weight.shape[0]
    eye = torch.eye(out, dtype=gram.dtype, device=gram.device)
    kfac = KFAC(
        {name: (gram, eye)},
        bias=[name] if name in bias else [],
        transposed=[name] if name in transposed else [],
    )
    return kfac.to(dtype=torch.float64)


@dataclass(frozen=True)
class RegmeanSystem:
    """One layer's RegMean system S = Σ_t α_t G̃_t, judged as :func:`regmean` judges it.

    Attributes:
        name: the module.
        min_eigenvalue: λ_min(S), computed in float64.
        threshold: τ = (ε/2)·Σ_t |α_t|·‖G_t‖_F, the uncertainty of S's eigenvalues from the
            rounding of Grams given in a dtype of machine epsilon ε (``dtype``).
        damping: 0 when λ_min > τ; else the δ (added to every G_t) that lifts λ_min clear of
            the damped threshold with a factor 2 to spare, or ``inf`` when Σ α_t ≤ 0.
        dtype: the coarsest dtype the Grams were given in.
    """

    name: str
    min_eigenvalue: float
    threshold: float
    damping: float
    dtype: torch.dtype

    @property
    def ok(self) -> bool:
        """Whether :func:`regmean` solves this layer."""
        return self.damping == 0.0

    def describe(self) -> str:
        """One line: the layer, λ_min, τ and the damping it needs."""
        need = "" if self.ok else f"; needs damping ≥ {self.damping:.2e}"
        return (
            f"{self.name!r}: λ_min = {self.min_eigenvalue:.3e}, threshold {self.threshold:.3e}"
            f"{need}"
        )


def regmean_systems(
    grams: Sequence[Mapping[str, Tensor]],
    alphas: Sequence[float],
    *,
    off_diagonal: float = REGMEAN_OFF_DIAGONAL,
) -> list[RegmeanSystem]:
    r"""Every layer's RegMean system, judged without merging (the check :func:`regmean` runs).

    Refuses S = Σ_t α_t G̃_t unless λ_min(S) > τ = (ε/2) Σ_t |α_t| ‖G_t‖_F (see
    :func:`regmean`): ε is the machine epsilon of the coarsest dtype the Grams were given in;
    G̃_t's rounding error r·E + (1 − r)·diag(E) has ‖·‖_F ≤ ‖E‖_F, so τ bounds it too. S and its
    spectrum are computed in float64, where their own round-off (≈ n ε₆₄ ‖S‖) is far below τ
    for Grams given in float32 or coarser.

    Example:
        >>> import torch
        >>> g = {"fc": torch.tensor([[1.0, 1.0], [1.0, 1.0]])}  # rank 1: singular
        >>> [s.ok for s in regmean_systems([g], [1.0], off_diagonal=1.0)], [s.ok for s in regmean_systems([g], [1.0])]
        ([False], [True])
    """
    if not 0.0 <= off_diagonal <= 1.0 or isinstance(off_diagonal, bool):
        raise ArgumentError(
            f"off_diagonal (Jin et al.'s factor on the Grams' off-diagonal entries) must be in "
            f"[0, 1], got {off_diagonal!r}"
        )
    out = []
    for name in grams[0]:
        layer = [g[name] for g in grams]
        given = coarsest_dtype(*(g.dtype for g in layer))
        eps = torch.finfo(given if given is not None else torch.float64).eps
        wide = [g.to(torch.float64) for g in layer]
        scaled = [_off_diagonal_scaled(g, off_diagonal) for g in wide]
        total = sum((a * g for a, g in zip(alphas, scaled, strict=True)), torch.zeros_like(wide[0]))
        lam = float(torch.linalg.eigvalsh((total + total.T) / 2)[0])
        frobenius = [float(torch.linalg.matrix_norm(g)) for g in wide]
        tau = eps / 2 * sum(abs(a) * f for a, f in zip(alphas, frobenius, strict=True))
        damping = 0.0
        if not lam > tau:
            lift = sum(alphas) - eps / 2 * sum(abs(a) for a in alphas) * math.sqrt(total.shape[0])
            damping = 2 * (tau - lam) / lift if lift > 0 else math.inf
            damping = max(damping, math.ulp(tau) if tau > 0 else torch.finfo(torch.float64).tiny)
        out.append(RegmeanSystem(name, lam, tau, damping, given or torch.float64))
    return out


def raise_unresolved(systems: Sequence[RegmeanSystem]) -> None:
    """Raise one :class:`NotPositiveDefiniteError` naming every layer of ``systems`` that
    :func:`regmean` cannot solve, with the damping that lifts them all (its
    ``suggested_delta``); nothing when all are fine."""
    bad = [s for s in systems if not s.ok]
    if not bad:
        return
    needed = max(s.damping for s in bad)
    given = str(bad[0].dtype).removeprefix("torch.")
    fix = (
        f"damp the Grams, G_t + δ·I with δ ≥ {needed:.2e} (above every threshold listed), or "
        "scale their off-diagonal entries (off_diagonal < 1, Jin et al.)"
        if math.isfinite(needed)
        else "the α_t sum to ≤ 0, so no damping lifts them: use positive alphas"
    )
    err = NotPositiveDefiniteError(
        f"RegMean system Σ_t α_t G_t is singular in {len(bad)} of {len(systems)} layers ("
        + "; ".join(s.describe() for s in bad)
        + f") at the precision of the Grams, given in {given}: λ_min is not above the "
        f"threshold, the uncertainty of the eigenvalues. Fix: {fix}."
    )
    err.suggested_delta = needed if math.isfinite(needed) else None
    raise err


def _off_diagonal_scaled(gram: Tensor, r: float) -> Tensor:
    """r·G + (1 − r)·diag(G): Jin et al.'s reduced off-diagonal Gram (G itself for r = 1)."""
    if r == 1.0:
        return gram
    scaled = r * gram  # one rounding of each off-diagonal entry; the diagonal is copied exactly
    scaled.diagonal().copy_(gram.diagonal())
    return scaled


def gradient_matching(
    base: Params,
    finetuned: Sequence[Params],
    curvatures: Sequence[CurvatureLike],
    *,
    prior: CurvatureLike,
    alphas: float | Sequence[float] = 1.0,
    kernel: Kernel | None = SELECTED,
    solver: SolverSpec | None = None,
    **removed: NoReturn,
) -> dict[str, Tensor]:
    r"""The uncertainty-based gradient-matching merge (Eq. 6).

    .. math::

        \hat\theta_{1:T} = \theta_{LLM} + \bar H^{-1} \sum_t \alpha_t (H_0 + H_t)(\theta_t - \theta_{LLM}),
        \qquad \bar H = H_0 + \sum_t \alpha_t H_t .

    It is exact (equals the multi-task MAP θ_{1:T}) when every loss is quadratic with Hessian
    H_t, and otherwise a first-order correction of task arithmetic for the gradient mismatch of
    Eq. 2.

    Args:
        base: θ_LLM.
        finetuned: θ_1, …, θ_T, each with the keys and shapes of ``base``.
        curvatures: H_1, …, H_T (SUM over each task's examples), or floats (δ·I).
        prior: H_0, the precision of the prior around ``base`` (a curvature, or a float δ: δ·I).
        alphas: one α for all tasks, or one per task.
        kernel: where every curvature is diagonal or δ·I, the evaluator of the elementwise
            merge. Default: the fastest certified one, as the streaming engine chooses it
            (:class:`gradmerge.elementwise.matching.Selected`: on a CPU the C loop of
            :mod:`gradmerge.kernels` for float32/float64 tensors of 4096 elements or more,
            bit-identical to the chunked pass and falling back to it wherever it cannot be built;
            ``gm.fused_kernels("off")`` or ``$GRADMERGE_FUSED=off`` turns it off, as for the
            engine). ``None``: the chunked torch pass of :mod:`gradmerge.elementwise.matching` alone,
            which compiles nothing. Or a :class:`gradmerge.kernels.Fused` (``Fused("on")``).
        solver: how H̄⁻¹ is applied where it is iterative (K-FAC, sums, matrix-free):
            :class:`gradmerge.SolverSpec`; ``None``: each operator's defaults. With
            ``warm_start``, K-FAC layers may start from the task-arithmetic solution Σ_t α_t τ_t.

    Returns:
        The merged parameters, a new dict with the keys of ``base``. ``gm.with_solution(
        gm.gradient_matching, ...)`` returns them in a :class:`Merged` with the
        :class:`gradmerge.Solution` of H̄ x = rhs (per K-FAC layer: method, iterations,
        certified residual). The fused elementwise path (diagonal and δ·I curvatures) solves
        exactly in the same pass as the merge: its report has the method only and an empty
        ``value``.

    Raises:
        StructureError, DTypeError, DeviceError, NonFiniteError: inputs that do not fit together.
        NotPositiveDefiniteError: a curvature that is not PSD, or H̄ singular (add damping to H_0).
        ArgumentError: a wrong number of curvatures or alphas.

    Example:
        >>> import torch, gradmerge as gm
        >>> base = {"w": torch.zeros(2)}
        >>> fts = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 1.0])}]
        >>> Hs = [gm.Diagonal({"w": torch.tensor([9.0, 0.0])}), gm.Diagonal({"w": torch.tensor([0.0, 9.0])})]
        >>> gm.gradient_matching(base, fts, Hs, prior=1.0)
        {'w': tensor([1., 1.])}
    """
    _refuse_removed("gradient_matching", removed)
    solved = _gradient_matching(base, finetuned, curvatures, prior, alphas, kernel, solver)
    return solved.params


def _gradient_matching(
    base: Params,
    finetuned: Sequence[Params],
    curvatures: Sequence[CurvatureLike],
    prior: CurvatureLike,
    alphas: float | Sequence[float],
    kernel: Kernel | None,
    solver: SolverSpec | None,
) -> Merged:
    """:func:`gradient_matching` with the solve's report (its arguments, checked here)."""
    tasks = len(finetuned)
    if tasks == 0:
        raise ArgumentError("gradient_matching needs at least one fine-tuned model, got none")
    if len(curvatures) != tasks:
        raise ArgumentError(
            f"got {tasks} fine-tuned models but {len(curvatures)} curvatures: pass one per model"
        )
    P.check_params(base, name="base", finite=False)
    base, finetuned = P.detached(base), [P.detached(ft) for ft in finetuned]
    weights = _alphas(alphas, tasks, dtype=_dtype_of(base))
    names = ["prior", *(f"curvatures[{t}]" for t in range(tasks))]
    h0, *hs = (
        _curvature(c, base, name=n, psd=False)
        for c, n in zip([prior, *curvatures], names, strict=True)
    )
    elementwise = [_elementwise.parts(h) for h in (h0, *hs)]
    with _negative_alphas_named(weights):
        if all(part is not None for part in elementwise):  # diagonal / δ·I: one fused pass
            for t, ft in enumerate(finetuned):
                P.check_params(ft, name=f"finetuned[{t}]", finite=False)
                P.check_compatible(base, ft, ref_name="base", name=f"finetuned[{t}]")
            prior_part, *task_parts = cast(list[_elementwise.Part], elementwise)
            precisions = [h.coarsest_dtype for h in (h0, *hs)]
            merged = _elementwise.merge(
                base,
                finetuned,
                weights,
                prior_part,
                task_parts,
                names=names,
                precisions=precisions,
                kernel=kernel,
            )
            report = Solution({}, "exact (elementwise, fused with the merge)")
        else:
            merged, report = _generic_merge(base, finetuned, weights, h0, hs, names, solver)
    return Merged(merged, report)


def _generic_merge(
    base: Params,
    finetuned: Sequence[Params],
    weights: Sequence[float],
    h0: Curvature,
    hs: Sequence[Curvature],
    names: Sequence[str],
    solver: SolverSpec | None,
) -> tuple[dict[str, Tensor], Solution]:
    """Eq. 6 through the operator algebra (any structure); inputs checked here."""
    P.check_finite(base, name="base")
    task_vectors = [
        _task_vector(base, ft, name=f"finetuned[{t}]") for t, ft in enumerate(finetuned)
    ]
    for h, n in zip([h0, *hs], names, strict=True):
        h.check_psd(name=n)

    merged_precision = h0  # H̄ = H_0 + Σ_t α_t H_t
    rhs = P.zeros_like(base)  # Σ_t α_t (H_0 + H_t)(θ_t − θ_LLM)
    for alpha, h, tau in zip(weights, hs, task_vectors, strict=True):
        merged_precision = merged_precision + alpha * h
        # α_t times the term, then added (two roundings, not the fused y + α·x of P.axpy): the
        # elementwise paths (_elementwise, _fused) round the same way, so all agree bit for bit
        rhs = P.add(rhs, P.scale(alpha, P.add(h0.mv(tau), h.mv(tau))))
    guess = None  # the task-arithmetic solution Σ_t α_t τ_t, where a warm start may use it
    if solver is not None and solver.warm_start:
        guess = P.zeros_like(base)
        for alpha, tau in zip(weights, task_vectors, strict=True):
            guess = P.axpy(alpha, tau, guess)
    x, report = _solve(merged_precision, rhs, solver, guess)
    merged = P.add(base, x)  # Eq. 6
    P.check_result_finite(merged, what="merged", alphas=weights)
    return merged, report


def remove(
    base: Params,
    finetuned: Params,
    curvature: CurvatureLike,
    *,
    remaining: CurvatureLike,
    prior: CurvatureLike,
    alpha: float = 1.0,
    solver: SolverSpec | None = None,
    **removed: NoReturn,
) -> dict[str, Tensor]:
    r"""Remove data (or a task) D_t from a model by gradient matching (Eq. 13).

    .. math::

        \hat\theta_{\setminus t} = \theta_{LLM}
            - \alpha_t \bar H_{\setminus t}^{-1} (H_0 + H_t)(\theta_t - \theta_{LLM}),

    where θ_t was fine-tuned on D_t from θ_LLM with prior precision H_0 (Eq. 15), H_t is the
    curvature of D_t, and α_t the weight D_t had in θ_LLM's training loss (Eq. 9). Exact for
    linear regression, where it reproduces Cook's formula (Eq. 14–16).

    Args:
        base: θ_LLM, trained on all data including D_t.
        finetuned: θ_t.
        curvature: H_t (SUM over D_t's examples), or a float (δ·I).
        remaining: H̄_\t = δI + ∇²ℓ̄_\t(θ_LLM), the curvature at ``base`` of the data that stays,
            INCLUDING the base model's own regulariser δ·I (``C_remaining + delta``).
        prior: H_0 used when fine-tuning θ_t.
        alpha: α_t.
        solver: how H̄_\t⁻¹ is applied where it is iterative (:class:`gradmerge.SolverSpec`).

    Returns:
        The parameters without D_t; ``gm.with_solution(gm.remove, ...)`` returns them in a
        :class:`Merged` with the solve's report (the elementwise path: what its pass measured).

    Example:
        >>> import torch, gradmerge as gm
        >>> base, ft = {"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}
        >>> gm.remove(base, ft, gm.Diagonal({"w": torch.tensor([1.0])}), remaining=4.0, prior=1.0)
        {'w': tensor([0.5000])}
    """
    _refuse_removed("remove", removed)
    return _remove(base, finetuned, curvature, remaining, prior, alpha, solver).params


def _remove(
    base: Params,
    finetuned: Params,
    curvature: CurvatureLike,
    remaining: CurvatureLike,
    prior: CurvatureLike,
    alpha: float,
    solver: SolverSpec | None,
) -> Merged:
    """:func:`remove` with the solve's report (its arguments, checked here)."""
    P.check_params(base, name="base", finite=False)
    base, finetuned = P.detached(base), P.detached(finetuned)
    (weight,) = _alphas([alpha], 1, dtype=_dtype_of(base), name="alpha")
    fast = _remove_elementwise(base, finetuned, (prior, curvature, remaining), weight)
    if fast is not None:  # an elementwise division: exact; the pass measured the step
        out, stats = fast
        report = Solution(
            {}, "exact (elementwise, fused with the removal)", measured=stats.as_dict()
        )
        return Merged(out, report)
    P.check_params(base, name="base")
    tau = _task_vector(base, finetuned, name="finetuned")
    h0 = _curvature(prior, base, name="prior")
    ht = _curvature(curvature, base, name="curvature")
    rest = _curvature(remaining, base, name="remaining")
    correction, report = _solve(rest, P.add(h0.mv(tau), ht.mv(tau)), solver)
    removed = P.axpy(-weight, correction, base)  # Eq. 13
    P.check_result_finite(removed, what="removal result", alphas=[weight], small="remaining")
    return Merged(removed, report)


def _remove_elementwise(
    base: Params,
    finetuned: Params,
    curvatures: tuple[CurvatureLike, CurvatureLike, CurvatureLike],
    alpha: float,
) -> tuple[dict[str, Tensor], _removal.RemovalStats] | None:
    """Eq. 13 in one fused pass (:mod:`gradmerge._removal`) when every curvature — ``(prior,
    curvature, remaining)`` — is diagonal or δ·I, with what the pass measured; None otherwise, or
    when a value check fails (the generic path then names the cause)."""
    P.check_params(finetuned, name="finetuned", finite=False)
    P.check_compatible(base, finetuned, ref_name="base", name="finetuned")
    terms = []
    for value, name in zip(curvatures, ("prior", "curvature", "remaining"), strict=True):
        c = _curvature(value, base, name=name, psd=False)
        part = _elementwise.parts(c)
        if part is None:
            return None
        terms.append(part)
    return _removal.remove(base, finetuned, *terms, alpha=alpha)


def influence_remove(
    base: Params,
    gradient: Params,
    *,
    remaining: CurvatureLike,
    alpha: float = 1.0,
    solver: SolverSpec | None = None,
    **removed: NoReturn,
) -> dict[str, Tensor]:
    r"""Remove data D_t with the influence-function step of Koh & Liang (2017) (Sec. 1.4).

    .. math::

        \hat\theta_{\setminus t} = \theta_{LLM} + \alpha_t \bar H_{\setminus t}^{-1} g_t,
        \qquad g_t = \nabla \bar\ell_t(\theta_{LLM}).

    The appendix prints it without α_t (the case α_t = 1); the α_t follows from Eq. 11 without
    the Taylor step of Eq. 12 (see theory/ERRATA.md). Exact for linear regression. ``solver`` and
    :func:`with_solution` as for :func:`remove`.

    Example:
        >>> import torch, gradmerge as gm
        >>> gm.influence_remove({"w": torch.tensor([1.0])}, {"w": torch.tensor([-2.0])}, remaining=4.0)
        {'w': tensor([0.5000])}
    """
    _refuse_removed("influence_remove", removed)
    return _influence_remove(base, gradient, remaining, alpha, solver).params


def _influence_remove(
    base: Params,
    gradient: Params,
    remaining: CurvatureLike,
    alpha: float,
    solver: SolverSpec | None,
) -> Merged:
    """:func:`influence_remove` with the solve's report (its arguments, checked here)."""
    P.check_params(base, name="base")
    P.check_params(gradient, name="gradient")
    P.check_compatible(base, gradient, ref_name="base", name="gradient")
    base, gradient = P.detached(base), P.detached(gradient)
    (weight,) = _alphas([alpha], 1, dtype=_dtype_of(base), name="alpha")
    rest = _curvature(remaining, base, name="remaining")
    x, report = _solve(rest, gradient, solver)
    removed = P.axpy(weight, x, base)
    P.check_result_finite(removed, what="removal result", alphas=[weight], small="remaining")
    return Merged(removed, report)


_Rule = ParamSpec("_Rule")


def with_solution(
    rule: Callable[_Rule, dict[str, Tensor]], /, *args: _Rule.args, **kwargs: _Rule.kwargs
) -> Merged:
    r"""Run ``rule`` on these arguments and return its parameters with the report of its solve.

    ``rule`` is one of the rules that solve a linear system — :func:`gradient_matching` (Eq. 6:
    H̄ x = Σ_t α_t (H_0 + H_t) τ_t), :func:`remove` (Eq. 13) or :func:`influence_remove` — and
    the arguments are its own, checked as it checks them. The parameters are those the rule
    returns, bit for bit. The one way to a merge's report: where it matters most is an
    approximate solve (``solver=gm.SolverSpec(approximate=True, maxiter=N)``), whose
    ``solution.success`` is False for a layer left above the tolerance.

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
    _refuse_removed(getattr(rule, "__name__", ""), arguments.pop("removed"))
    return solve(**arguments)


def _refuse_removed(rule: str, removed: Mapping[str, object]) -> None:
    """Name the replacement of a removed keyword (``return_solution``); any other unknown keyword
    is a TypeError, as Python raises it."""
    if "return_solution" in removed:
        raise ArgumentError(
            f"{rule}(return_solution=...) no longer exists: {rule} returns the parameters; for "
            f"them with the solve's report call gm.with_solution(gm.{rule}, <the same "
            "arguments>), which returns a gm.Merged (.params, .solution)"
        )
    if removed:
        raise TypeError(f"{rule}() got an unexpected keyword argument {next(iter(removed))!r}")


_SOLVING: dict[Callable[..., object], Callable[..., Merged]] = {
    gradient_matching: _gradient_matching,
    remove: _remove,
    influence_remove: _influence_remove,
}
"""Each rule that solves a system → its implementation with the report (:func:`with_solution`)."""


# ----- input handling shared by the rules ------------------------------------------------------
def _solve(
    precision: Curvature, rhs: Params, solver: SolverSpec | None, guess: Params | None = None
) -> tuple[dict[str, Tensor], Solution]:
    """(precision⁻¹ rhs, the solve's report), run as ``solver`` says."""
    solved = precision.solve_info(rhs, solver, guess=guess)
    return solved.value, solved


def _alphas(
    alphas: float | Sequence[float],
    tasks: int,
    *,
    dtype: torch.dtype = torch.float64,
    name: str = "alphas",
) -> list[float]:
    """α_t as floats: real numbers (not strings or bools), finite and representable in ``dtype``
    (the parameters' dtype, in which each α multiplies a tensor)."""
    if isinstance(alphas, Tensor):
        alphas = alphas.tolist()
    iterable = isinstance(alphas, Iterable) and not isinstance(alphas, (str, bytes))
    values: list[object] = list(cast(Iterable[float], alphas)) if iterable else [alphas] * tasks
    if len(values) != tasks:
        raise ArgumentError(
            f"got {len(values)} {name} for {tasks} fine-tuned models: pass one α per model, "
            "or a single number for all"
        )
    for a in values:
        if isinstance(a, bool) or not isinstance(a, numbers.Real):
            raise ArgumentError(
                f"{name} must be numbers, got {a!r} ({type(a).__name__}): pass e.g. 0.5, not '0.5'"
            )
    floats = [float(cast(float, a)) for a in values]
    largest = torch.finfo(dtype).max
    bad = [a for a in floats if not math.isfinite(a) or abs(a) > largest]
    if bad:
        raise ArgumentError(
            f"{name} must be finite numbers of magnitude ≤ {largest:.3e} (the largest "
            f"{str(dtype).removeprefix('torch.')}), got {bad[0]!r}: use a moderate α "
            "(typically 0 < α ≤ 1)"
        )
    return floats


def _dtype_of(params: Params) -> torch.dtype:
    return next(iter(params.values())).dtype


@contextmanager
def _negative_alphas_named(alphas: Sequence[float]) -> Iterator[None]:
    """Add to a singular-system error that negative α_t subtract curvature from H̄ — the likely
    cause, for which a larger prior is not the first fix."""
    try:
        yield
    except NotPositiveDefiniteError as err:
        negative = [f"alphas[{t}] = {a:g}" for t, a in enumerate(alphas) if a < 0]
        if not negative:
            raise
        cause = str(err).split(PD_FIX)[0]
        raise NotPositiveDefiniteError(
            f"{cause}{', '.join(negative)} < 0 subtracts that task's curvature from "
            "H̄ = H_0 + Σ_t α_t H_t: make |α_t| smaller (or α_t ≥ 0), or make the prior larger "
            "than |α_t| times that curvature."
        ) from err


def _task_vector(base: Params, finetuned: Params, *, name: str) -> dict[str, Tensor]:
    P.check_params(finetuned, name=name)
    P.check_compatible(base, finetuned, ref_name="base", name=name)
    return P.sub(finetuned, base)


def _curvature(value: CurvatureLike, base: Params, *, name: str, psd: bool = True) -> Curvature:
    if isinstance(value, bool) or not isinstance(value, (Curvature, int, float)):
        raise TypeError(
            f"{name} must be a curvature (gm.Diagonal, gm.Dense, ...) or a float δ meaning δ·I, "
            f"got {type(value).__name__}"
        )
    if isinstance(value, (int, float)):
        _check_delta(float(value), _dtype_of(base), name=name)
    curvature = ScaledIdentity(float(value)) if isinstance(value, (int, float)) else value
    curvature.check_covers(base, name=name)
    if psd:
        curvature.check_psd(name=name)
    return curvature


def _check_delta(delta: float, dtype: torch.dtype, *, name: str) -> None:
    """A float δ (δ·I) must be ≥ 0 (a precision) and, if not 0, a normal number of ``dtype``:
    a subnormal δ carries few significant bits, so products with it are rounded coarsely and
    its reciprocal overflows."""
    if delta < 0:
        raise NotPositiveDefiniteError(
            f"{name} is not positive semi-definite: {name} = {delta:g} is a negative precision "
            f"δ·I, and a prior or curvature precision must be ≥ 0; pass δ ≥ 0 (e.g. "
            f"{name}=1e-6)"
        )
    tiny = torch.finfo(dtype).tiny
    if 0 < delta < tiny:
        raise ArgumentError(
            f"{name} = {delta:g} is below the smallest normal {str(dtype).removeprefix('torch.')} "
            f"number ({tiny:.3e}): products with it lose their precision and its reciprocal "
            f"overflows; pass δ ≥ {tiny:.3e} (typically 1e-6), 0, or float64 parameters"
        )


def refine(
    theta: Params,
    base: Params,
    gradients: Sequence[Callable[[Params], Params]],
    curvatures: Sequence[CurvatureLike | Callable[[Params], CurvatureLike]],
    *,
    prior: CurvatureLike,
    alphas: float | Sequence[float] = 1.0,
    steps: int = 1,
) -> list[dict[str, Tensor]]:
    r"""Iterative refinement of a merge towards the exact multi-task MAP (Sec. 1.5, future work).

    The appendix proposes to "take a few optimization steps aiming for the MAP estimate of the
    exact posterior, and then use the current iterate for the Taylor approximation in Eq. 2".
    Expanding each ∇ℓ̄_t around the current iterate θ^k instead of θ_t, the stationarity
    condition H_0(θ − θ_LLM) + Σ_t α_t ∇ℓ̄_t(θ) = 0 of θ_{1:T} becomes

    .. math::

        \theta^{k+1} = \theta^k - \big(H_0 + \sum_t \alpha_t H_t^k\big)^{-1}
            \Big[H_0(\theta^k - \theta_{LLM}) + \sum_t \alpha_t \nabla\bar\ell_t(\theta^k)\Big],

    a Newton step on the multi-task objective, taken with backtracking on the norm of the
    stationarity residual R(θ) = H_0(θ − θ_LLM) + Σ_t α_t ∇ℓ̄_t(θ) (halving the step until ‖R‖
    falls; a step that cannot reduce it is not taken). With curvatures recomputed at θ^k (pass
    callables θ ↦ H_t(θ)) it is damped Newton, which converges quadratically near θ_{1:T}; with
    fixed H_t (e.g. at θ_t) a quasi-Newton iteration. Start from θ^0 = :func:`gradient_matching`.

    Args:
        theta: θ^0, the starting merge.
        base: θ_LLM.
        gradients: θ ↦ ∇ℓ̄_t(θ), one per task (needs the tasks' data or a model of it).
        curvatures: H_t, or callables θ ↦ H_t(θ) evaluated at every iterate. They need not be
            PSD (exact Hessians of non-convex losses are not); H̄ must be positive definite.
        prior: H_0.
        alphas: α_t.
        steps: how many steps.

    Returns:
        The iterates θ^1, …, θ^steps.
    """
    tasks = len(gradients)
    if len(curvatures) != tasks:
        raise ArgumentError(f"got {tasks} gradient functions but {len(curvatures)} curvatures")
    if steps < 1:
        raise ArgumentError(f"steps must be at least 1, got {steps}")
    weights = _alphas(alphas, tasks)
    P.check_params(base, name="base")
    P.check_params(theta, name="theta")
    P.check_compatible(base, theta, ref_name="base", name="theta")
    h0 = _curvature(prior, base, name="prior")

    def stationarity(point: Params) -> dict[str, Tensor]:
        """R(θ) = H_0(θ − θ_LLM) + Σ_t α_t ∇ℓ̄_t(θ), zero at θ_{1:T}."""
        out = h0.mv(P.sub(point, base))
        for t, (alpha, grad) in enumerate(zip(weights, gradients, strict=True)):
            g = grad(point)
            P.check_params(g, name=f"gradients[{t}](theta)")
            P.check_compatible(base, g, ref_name="base", name=f"gradients[{t}](theta)")
            out = P.axpy(alpha, g, out)
        return out

    iterates = []
    current = dict(theta)
    residual = stationarity(current)
    for _ in range(steps):
        precision: Curvature = h0
        for t, (alpha, h) in enumerate(zip(weights, curvatures, strict=True)):
            h_t = h(current) if callable(h) else h
            # a Newton step needs H̄ positive definite, not each H_t: a task Hessian of a
            # non-convex loss may be indefinite (H̄'s solve refuses an indefinite sum)
            h_t = _curvature(h_t, base, name=f"curvatures[{t}]", psd=False)
            precision = precision + alpha * h_t
        direction = precision.solve(residual)
        # backtracking on ‖R‖, which a Newton direction decreases: far from θ_{1:T} a full step
        # can overshoot (the expansion is local)
        size, norm = 1.0, P.norm(residual)
        for _halving in range(30):
            trial = P.axpy(-size, direction, current)
            trial_residual = stationarity(trial)
            if P.norm(trial_residual) < norm:
                break
            size /= 2
        else:  # no decrease: at the precision floor, or not a descent direction
            iterates.append(current)
            continue
        current, residual = trial, trial_residual
        iterates.append(current)
    return iterates
