"""K-FAC curvature: per layer a (lazy, exact) sum of Kronecker products Σ_k A_k ⊗ G_k.

Convention (docs/architecture.md): a layer ``m`` with weight V of shape (out, in) — the
``nn.Linear`` layout — and optionally a bias is treated as one matrix [V | b] of shape
(out, in + 1), the bias being the LAST input column. A term A ⊗ G acts as [V | b] ↦ G [V | b] A,
with A (in[+1])² and G out². The operator covers ``f"{m}.weight"`` and, for layers in ``bias``,
``f"{m}.bias"``.

Sums stay exact: ``K1 + K2`` keeps both Kronecker terms per layer (it never sums the factors,
which would be a different, approximate operator); ``K + δ`` adds the term I ⊗ δI. Solves
(:mod:`gradmerge.solvers`), per layer:

- δ·I plus any number of terms (every merge and removal with a prior): CG in the eigenbasis of
  the collapsed factors, preconditioned by the exact diagonal there, exact at once for one term
  (:mod:`gradmerge.solvers.kfac_cg`), the residual certified in float64;
- one or two terms without δ·I: exact eigendecompositions (:mod:`gradmerge.solvers.kronecker`);
- three or more terms without δ·I: the CG of the first case with δ = 0.

``solve_info(v, solver)`` runs the solver it is given (:class:`gradmerge.KroneckerCG`, its
defaults for ``None``; the operator holds no settings) and reports each layer's method,
iterations and residual (:class:`Solution`); a solve that does not reach its tolerance raises.

Terms with an identity factor are folded exactly before any of this: A₁ ⊗ c₁I + A₂ ⊗ c₂I =
(c₁A₁ + c₂A₂) ⊗ I and c₁I ⊗ G₁ + c₂I ⊗ G₂ = I ⊗ (c₁G₁ + c₂G₂), so δ·I joins such a term.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from gradmerge import params as P
from gradmerge.curvature.base import Curvature, IncompatibleStructures
from gradmerge.curvature.identity import ScaledIdentity
from gradmerge.errors import RemovedArgumentError, StructureError
from gradmerge.params import Layout, Params
from gradmerge.solvers import kfac_cg, kronecker
from gradmerge.solvers.cg import default_tol
from gradmerge.solvers.kronecker import Term, eye_like, identity_multiple
from gradmerge.solvers.solution import Result, Solution
from gradmerge.solvers.spec import KroneckerCG, Solver, solver_for

EXACT_EIG_MAX_SIZE = 4096
"""Layers with several Kronecker terms and at most this many parameters get their exact
smallest eigenvalue from the dense sum of Kronecker products; larger ones a lower bound."""


_REMOVED = {"cg_tol": "tol", "cg_maxiter": "maxiter", "cg_approximate": "approximate"}
"""K-FAC's solver keywords and attributes in gradmerge 0.1.0 → their :class:`KroneckerCG` field."""

_AT_THE_CALL = "K.solve_info(v, SOLVER) or the rule's solver=SOLVER"
"""Where a K-FAC solve's settings go: the call that solves."""


def _refuse_removed(given: Mapping[str, Any]) -> None:
    """Refuse the keywords ``KFAC`` no longer takes (``cg_*`` of 0.1.0, and ``solver``),
    naming their replacement: a :class:`KroneckerCG` passed to the call that solves."""
    for name in given:
        if name not in (*_REMOVED, "solver"):
            raise TypeError(f"KFAC() got an unexpected keyword argument {name!r}")
    if "solver" in given:
        raise RemovedArgumentError(
            f"KFAC no longer takes solver=: an operator holds no solver "
            f"settings; pass the solver to the call that solves, "
            f"{_AT_THE_CALL.replace('SOLVER', repr(given['solver']))}"
        )
    if given:
        spec = ", ".join(f"{_REMOVED[k]}={v!r}" for k, v in given.items())
        raise RemovedArgumentError(
            f"KFAC no longer takes {', '.join(given)}: pass gm.KroneckerCG({spec}) to the call "
            f"that solves, {_AT_THE_CALL.replace('SOLVER', f'gm.KroneckerCG({spec})')} "
            "(removed after gradmerge 0.1.0)"
        )


class _RemovedSetting:
    """A removed solver attribute (``K.cg_maxiter``, ``K.solver``): reading or setting it
    raises, naming the solver object at the call that replaced it, instead of a setting
    silently ignored."""

    def __set_name__(self, owner: type, name: str) -> None:
        field = _REMOVED.get(name)
        given = f"gm.KroneckerCG({field}=...)" if field else "gm.KroneckerCG(...)"
        self.message = (
            f"KFAC.{name} was removed: an operator "
            f"holds no solver settings; pass {given} to the call that solves, "
            f"{_AT_THE_CALL.replace('SOLVER', given)}"
        )

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        raise AttributeError(self.message)

    def __set__(self, instance: object, value: object) -> None:
        raise AttributeError(self.message)


class KFAC(Curvature):
    """Per-layer sums of Kronecker products, Σ_k A_k ⊗ G_k, as a curvature operator.

    Args:
        factors: module name → (A, G), or → a list of (A, G) terms (a lazy exact sum).
        bias: names of the modules whose A includes the bias as its last row/column.
        transposed: modules whose weight is stored as (in, out) — Hugging Face's GPT-2
            ``Conv1D`` and ``nn.Embedding`` (y = onehot(x) W) — and is transposed to (out, in).
        weight_shapes: the stored weight shape of modules whose weight is not a matrix, e.g. a
            ``Conv2d`` weight (out, in, kh, kw), which is viewed as (out, in·kh·kw).
        counts: module name → M, the number of rows (kept positions, or examples) the layer's
            A is a mean over, as estimated (``KFACFactors.counts``); M·A = Σ a aᵀ is the raw
            input Gram that RegMean needs. Kept by ``to`` and ``scaled`` (they leave A alone),
            saved in curvature files; a sum of terms has no single M and keeps none.

    The operator holds no solver settings: they go to the call that solves,
    ``K.solve_info(v, gm.KroneckerCG(...))`` or a rule's ``solver=`` (``K.solve(v)`` runs
    ``gm.KroneckerCG()``). The keywords ``solver`` (before this release) and ``cg_tol``,
    ``cg_maxiter``, ``cg_approximate`` (0.1.0) are refused with
    :class:`~gradmerge.errors.RemovedArgumentError` naming that call.

    Example:
        >>> import torch, gradmerge as gm
        >>> A, G = torch.eye(3), 2 * torch.eye(2)           # one layer: weight (2, 2) + bias
        >>> K = gm.KFAC({"fc": (A, G)}, bias=["fc"])
        >>> x = {"fc.weight": torch.ones(2, 2), "fc.bias": torch.ones(2)}
        >>> (K + 2.0).solve(x)["fc.bias"]
        tensor([0.2500, 0.2500])
        >>> s = (K + 2.0).solve_info(x, gm.KroneckerCG(tol=1e-8, maxiter=50))
        >>> s.parts["fc"].residual <= 1e-8, s.result
        (True, <Result.successful: 'successful'>)
    """

    rank = 3
    cg_tol, cg_maxiter, cg_approximate = _RemovedSetting(), _RemovedSetting(), _RemovedSetting()
    solver = _RemovedSetting()

    def __init__(
        self,
        factors: Mapping[str, Term | list[Term]],
        *,
        bias: Iterable[str] = (),
        transposed: Iterable[str] = (),
        weight_shapes: Mapping[str, tuple[int, ...]] | None = None,
        counts: Mapping[str, int] | None = None,
        **removed: Any,
    ) -> None:
        _refuse_removed(removed)
        if not factors:
            raise StructureError("KFAC needs factors for at least one module")
        self.bias, self.transposed = frozenset(bias), frozenset(transposed)
        self.weight_shapes = {k: tuple(v) for k, v in (weight_shapes or {}).items()}
        self.counts = _checked_counts(counts or {}, factors)
        for what, names in (("bias", self.bias), ("transposed", self.transposed)):
            unknown = set(names) - set(factors)
            if unknown:
                raise StructureError(f"{what} names modules without factors: {sorted(unknown)}")
        self.terms: dict[str, list[Term]] = {}
        for name, value in factors.items():
            terms = list(value) if isinstance(value, list) else [value]
            self.terms[name] = [self._check_term(name, a, g) for a, g in terms]
        self._cache: dict[str, Any] = {}

    # ----- construction checks ------------------------------------------------------------
    def _check_term(self, name: str, a: Tensor, g: Tensor) -> Term:
        for what, m in (("A", a), ("G", g)):
            if not isinstance(m, Tensor) or m.ndim != 2 or m.shape[0] != m.shape[1]:
                shape = tuple(m.shape) if isinstance(m, Tensor) else type(m).__name__
                raise StructureError(f"KFAC factor {what} of {name!r} must be square, got {shape}")
            P.check_params({f"{name}.{what}": m}, name="KFAC factors")
        if a.dtype != g.dtype or a.device != g.device:
            raise StructureError(f"KFAC factors of {name!r} differ in dtype or device")
        if name in self.bias and a.shape[0] < 2:
            raise StructureError(f"{name!r} has a bias, so A needs at least 2 rows")
        first = self.terms.get(name)
        if first and (first[0][0].shape != a.shape or first[0][1].shape != g.shape):
            raise StructureError(f"KFAC terms of {name!r} have different shapes")
        return a, g

    def __repr__(self) -> str:
        terms = {len(t) for t in self.terms.values()}
        return f"KFAC({len(self.terms)} layers, {'/'.join(map(str, sorted(terms)))} term(s))"

    # ----- layout --------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        out = []
        for name, terms in self.terms.items():
            a, g = terms[0]
            out.append((f"{name}.weight", torch.Size(self._weight_shape(name, a, g))))
            if name in self.bias:
                out.append((f"{name}.bias", torch.Size((g.shape[0],))))
        return tuple(out)

    def _weight_shape(self, name: str, a: Tensor, g: Tensor) -> tuple[int, ...]:
        if name in self.weight_shapes:
            return self.weight_shapes[name]
        n_out, n_in = g.shape[0], a.shape[0] - (name in self.bias)
        return (n_in, n_out) if name in self.transposed else (n_out, n_in)

    def _like(self) -> dict[str, Tensor]:
        a, _ = next(iter(self.terms.values()))[0]
        return {k: torch.empty(s, dtype=a.dtype, device=a.device) for k, s in self.layout}

    def _dtype_device(self) -> tuple[torch.dtype, torch.device]:
        a, _ = next(iter(self.terms.values()))[0]
        return a.dtype, a.device

    def _matrix(self, name: str, v: Params) -> Tensor:
        """[V | b] for layer ``name``, V the weight as an (out, in) matrix."""
        w = v[f"{name}.weight"]
        w = w.T if name in self.transposed else w.reshape(w.shape[0], -1)
        return torch.cat([w, v[f"{name}.bias"][:, None]], dim=1) if name in self.bias else w

    def _split(self, name: str, m: Tensor, out: dict[str, Tensor]) -> None:
        w = m[:, :-1] if name in self.bias else m
        a, g = self.terms[name][0]
        shape = self._weight_shape(name, a, g)
        out[f"{name}.weight"] = w.T if name in self.transposed else w.reshape(shape)
        if name in self.bias:
            out[f"{name}.bias"] = m[:, -1]

    # ----- operator ------------------------------------------------------------------------
    def mv(self, v: Params) -> dict[str, Tensor]:
        self.check_covers(v, name="the vector", ref_name="the vector")
        out: dict[str, Tensor] = {}
        for name, terms in self.terms.items():
            x = self._matrix(name, v)
            self._split(name, sum((g @ x @ a for a, g in terms), torch.zeros_like(x)), out)
        return out

    def solve(self, v: Params) -> dict[str, Tensor]:
        return self.solve_info(v).value

    def solve_info(
        self, v: Params, solver: Solver | None = None, *, guess: Params | None = None
    ) -> Solution:
        """The solution of K x = v with, per layer, the method, CG iterations and the relative
        residual ‖b − Kx‖/‖b‖ (recomputed in float64 for coarser dtypes); raises
        :class:`NotConvergedError` where a layer misses ``spec.tol``.

        Args:
            v: the right-hand side.
            solver: how to solve, a :class:`gradmerge.KroneckerCG`; ``None``: its defaults.
            guess: an estimate of x (e.g. the task-arithmetic solution of a merge), a starting
                point of the layers' CG where ``solver.warm_start`` and its residual is the
                smaller one (:func:`gradmerge.solvers.kfac_cg.solve`).

        Raises:
            ArgumentError: ``solver`` is not a :class:`gradmerge.KroneckerCG`.
        """
        spec = solver_for(solver, KroneckerCG, "KFAC")
        self.check_covers(v, name="the vector", ref_name="the vector")
        out: dict[str, Tensor] = {}
        parts: dict[str, Solution] = {}
        for name, terms in self.terms.items():
            b = self._matrix(name, v)
            delta, rest = kfac_cg.split_identity(terms)
            if delta == 0 and len(rest) <= 2:
                layer = self._direct(name, rest, b, spec.tol)
            else:
                x0 = self._matrix(name, guess) if guess is not None and spec.warm_start else None
                layer = kfac_cg.solve(name, delta, rest, b, spec=spec, x0=x0)
            values: dict[str, Tensor] = {}
            self._split(name, layer.x, values)
            out.update(values)
            parts[name] = Solution(
                values, layer.method, layer.iterations, layer.residual, Result.of(layer.success)
            )
        return Solution(
            out,
            "K-FAC per layer",
            iterations=sum(p.iterations for p in parts.values()),
            residual=max((p.residual for p in parts.values()), default=0.0),
            result=Result.of(all(p.success for p in parts.values())),
            parts=parts,
        )

    def _direct(
        self, name: str, terms: list[Term], b: Tensor, tol: float | None
    ) -> kfac_cg.LayerSolve:
        """One or two Kronecker terms, exactly (:func:`kronecker.factorise`, kept per layer)."""
        key = f"{name}:direct"
        if key not in self._cache:
            self._cache[key] = kronecker.factorise(name, terms)
        x = kronecker.apply_inverse(self._cache[key], b)
        bnorm = float(torch.linalg.norm(b.to(torch.float64)))
        r = float(torch.linalg.norm(kfac_cg.residual(0.0, terms, b, x)))
        residual = r / bnorm if bnorm > 0 else 0.0
        tol = default_tol(b.dtype) if tol is None else tol
        if residual > tol:
            raise kfac_cg.not_converged(name, residual, tol, b.dtype, "an exact solve")
        return kfac_cg.LayerSolve(x, f"{len(terms)}-term eigendecomposition", 0, residual)

    # ----- algebra -------------------------------------------------------------------------
    def _new(self, terms: dict[str, list[Term]], *, keep_counts: bool = False) -> KFAC:
        return KFAC(
            terms,
            bias=self.bias,
            transposed=self.transposed,
            weight_shapes=self.weight_shapes,
            counts=self.counts if keep_counts else None,
        )

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> KFAC:
        return self._new(
            {
                n: [
                    (a.to(device=device, dtype=dtype), g.to(device=device, dtype=dtype))
                    for a, g in t
                ]
                for n, t in self.terms.items()
            },
            keep_counts=True,
        )

    def scaled(self, c: float) -> KFAC:
        terms: dict[str, list[Term]] = {}
        for n, t in self.terms.items():
            terms[n] = []
            for a, g in t:
                scaled = c * g
                kronecker.derive_scaled(scaled, g, c)  # its eigendecomposition, if g's is known
                terms[n].append((a, scaled))
        return self._new(terms, keep_counts=True)

    def _add_same(self, other: KFAC) -> KFAC:
        if self.layout != other.layout or (self.bias, self.transposed) != (
            other.bias,
            other.transposed,
        ):
            raise StructureError("cannot add K-FAC curvatures over different layers or biases")
        return self._new({n: _combine(self.terms[n], other.terms[n]) for n in self.terms})

    def _promote(self, other: Curvature) -> KFAC:
        if not isinstance(other, ScaledIdentity):
            raise IncompatibleStructures(
                f"cannot add {type(other).__name__} to a KFAC curvature exactly as K-FAC; "
                "use gm.Blocks to combine structures over disjoint parameters"
            )
        terms = {}
        for name, t in self.terms.items():
            a, g = t[0]
            terms[name] = [(eye_like(a), other.delta * eye_like(g))]
        return self._new(terms)

    def check_psd(self, *, name: str, rtol: float | None = None) -> None:
        """:meth:`Curvature.check_psd`, decided without eigendecompositions where it can be.

        A sufficient test first, for layers of one term A ⊗ G: with U_F ≥ ‖F‖₂ (Frobenius),
        the tolerance's scale bounded from below by Rayleigh quotients of the factors (each
        ≤ λ_max; a few power steps), and τ_A = tol/(2U_G), τ_G = tol/(2U_A), a float64 Cholesky of
        F + (τ_F − c_F)I (c_F = n·ε₆₄·U_F covering its own round-off) that succeeds proves
        λ_min(F) > −τ_F, hence λ_min(A ⊗ G) ≥ −tol/2: the exact test would pass. Anything else
        (a Cholesky that fails, several terms, a tolerance below float64's round-off) goes to
        the exact eigenvalue test, which decides and words the error. A Cholesky costs a small
        fraction of an eigenvalue decomposition.
        """
        if not self._psd_by_cholesky(rtol):
            super().check_psd(name=name, rtol=rtol)

    def _psd_by_cholesky(self, rtol: float | None) -> bool:
        dtype = self.coarsest_dtype
        eps = torch.finfo(dtype if dtype is not None else torch.float64).eps
        r = rtol if rtol is not None else 100 * eps
        if any(len(t) != 1 for t in self.terms.values()):
            return False
        pairs = [t[0] for t in self.terms.values()]
        low = max(_rayleigh(a) * _rayleigh(g) for a, g in pairs)
        tol = r * max(1.0, low)  # ≤ the exact test's tolerance
        eps64 = torch.finfo(torch.float64).eps
        for pair in pairs:  # one layer's factors in float64 at a time
            wa, wg = (m.to(torch.float64) for m in pair)
            ua, ug = (float(torch.linalg.matrix_norm(w)) for w in (wa, wg))
            for wide, other_upper, own_upper in ((wa, ug, ua), (wg, ua, ug)):
                if identity_multiple(wide) is not None and float(wide[0, 0]) >= 0:
                    continue
                tau = tol / (2 * max(other_upper, torch.finfo(torch.float64).tiny))
                rounding = wide.shape[0] * eps64 * own_upper
                if not tau > 2 * rounding:
                    return False
                shifted = (wide + wide.T) / 2 + (tau - rounding) * eye_like(wide)
                if int(torch.linalg.cholesky_ex(shifted).info) != 0:
                    return False
        return True

    def min_eigenvalue(self) -> float:
        """The smallest eigenvalue: exact for one term per layer, and for two or more terms on
        layers of at most :data:`EXACT_EIG_MAX_SIZE` parameters (from the dense sum of Kronecker
        products); on larger layers with several terms, a lower bound (Weyl: the sum of the
        terms' minima). :attr:`min_eigenvalue_exact` says which."""
        low = float("inf")
        for terms in self.terms.values():
            a0, g0 = terms[0]
            if len(terms) == 1:
                ea, eg = self._eigenvalues(a0), self._eigenvalues(g0)
                low = min(low, float(torch.outer(eg, ea).min()))
            elif a0.shape[0] * g0.shape[0] <= EXACT_EIG_MAX_SIZE:
                dense = sum(torch.kron(g, a) for a, g in terms)
                low = min(low, float(torch.linalg.eigvalsh(dense)[0]))
            else:
                bound = 0.0
                for a, g in terms:
                    ea, eg = self._eigenvalues(a), self._eigenvalues(g)
                    bound += float(torch.outer(eg, ea).min())
                low = min(low, bound)
        return low

    @property
    def min_eigenvalue_exact(self) -> bool:
        return all(
            len(t) == 1 or t[0][0].shape[0] * t[0][1].shape[0] <= EXACT_EIG_MAX_SIZE
            for t in self.terms.values()
        )

    def _scale(self) -> float:
        """max over terms of ‖A‖₂‖G‖₂, from the factors' eigenvalues (symmetric factors: the
        largest |λ|), shared with :meth:`min_eigenvalue` — no singular value decomposition."""
        return max(
            float(self._eigenvalues(a).abs().max() * self._eigenvalues(g).abs().max())
            for t in self.terms.values()
            for a, g in t
        )

    def _eigenvalues(self, m: Tensor) -> Tensor:
        """Eigenvalues of one of this operator's factors, ascending: from the process-wide
        eigendecomposition when one is known (a solve will need it anyway), else computed once
        per operator without eigenvectors (a PSD check asks twice: the smallest eigenvalue, and
        the scale of its tolerance)."""
        key = f"eigenvalues/{id(m)}"
        if key not in self._cache:
            self._cache[key] = kronecker.eigenvalues(m)
        eigenvalues: Tensor = self._cache[key]
        return eigenvalues


def _rayleigh(m: Tensor, steps: int = 8) -> float:
    """A Rayleigh quotient vᵀMv/vᵀv after ``steps`` power steps from the all-ones vector: a
    lower bound of λ_max(M) for symmetric M, close to it for a dominant eigenvalue."""
    v = torch.ones(m.shape[0], 1, dtype=torch.float64, device=m.device)
    wide = m.to(torch.float64)
    for _ in range(steps):
        w = wide @ v
        norm = torch.linalg.vector_norm(w)
        if not bool(norm > 0):
            break
        v = w / norm
    return float((v.T @ wide @ v) / (v.T @ v))


def _checked_counts(counts: Mapping[str, int], factors: Mapping[str, Any]) -> dict[str, int]:
    unknown = sorted(set(counts) - set(factors))
    if unknown:
        raise StructureError(f"counts names modules without factors: {unknown}")
    bad = {
        n: m for n, m in counts.items() if isinstance(m, bool) or not isinstance(m, int) or m < 1
    }
    if bad:
        raise StructureError(f"counts must be positive integers (rows A is a mean over), got {bad}")
    return dict(counts)


def _combine(terms: list[Term], extra: list[Term]) -> list[Term]:
    """``terms + extra``, merging exactly the terms that share an identity factor:
    A₁ ⊗ c₁I + A₂ ⊗ c₂I = (c₁A₁ + c₂A₂) ⊗ I (RegMean's case, and δ·I with such terms), and
    c₁I ⊗ G₁ + c₂I ⊗ G₂ = I ⊗ (c₁G₁ + c₂G₂). Any other pair stays a separate Kronecker term
    (summing factors would be approximate)."""
    out = list(terms)
    for a, g in extra:
        ca, cg = identity_multiple(a), identity_multiple(g)
        for i, (a_i, g_i) in enumerate(out):
            if cg is not None and (cg_i := identity_multiple(g_i)) is not None:
                out[i] = (cg_i * a_i + cg * a, eye_like(g))
                break
            if ca is not None and (ca_i := identity_multiple(a_i)) is not None:
                out[i] = (eye_like(a), ca_i * g_i + ca * g)
                break
        else:
            out.append((a, g))
    return out
