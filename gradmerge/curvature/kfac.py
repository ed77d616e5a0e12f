"""K-FAC curvature: per layer a (lazy, exact) sum of Kronecker products Σ_k A_k ⊗ G_k.

Convention (DESIGN.md): a layer ``m`` with weight V of shape (out, in) — the ``nn.Linear``
layout — and optionally a bias is treated as one matrix [V | b] of shape (out, in + 1), the bias
being the LAST input column. A term A ⊗ G acts as [V | b] ↦ G [V | b] A, with A (in[+1])² and G
out². The operator covers ``f"{m}.weight"`` and, for layers in ``bias``, ``f"{m}.bias"``.

Sums stay exact: ``K1 + K2`` keeps both Kronecker terms per layer (it never sums the factors,
which would be a different, approximate operator); ``K + δ`` adds the term I ⊗ δI. Solves:

- one term: eigendecompositions of A and G, exactly;
- two terms: a simultaneous diagonalisation (A₂ in the A₁-metric, G₂ in the G₁-metric), exactly;
- more terms: conjugate gradients preconditioned with exact two-term solves (see
  :func:`_preconditioner` for the choice and its spectral bounds) — reported in ``solve_info``
  and raising if it does not converge.

Terms with an identity factor are folded exactly before any of this: A₁ ⊗ c₁I + A₂ ⊗ c₂I =
(c₁A₁ + c₂A₂) ⊗ I and c₁I ⊗ G₁ + c₂I ⊗ G₂ = I ⊗ (c₁G₁ + c₂G₂), so δ·I joins such a term.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradmerge import params as P
from gradmerge.curvature.base import Curvature, IncompatibleStructures, not_pd
from gradmerge.curvature.identity import ScaledIdentity
from gradmerge.errors import ArgumentError, NotPositiveDefiniteError, StructureError
from gradmerge.params import Layout, Params
from gradmerge.solve import solve_or_raise

Term = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class SolveInfo:
    """How a K-FAC solve went, per layer: method, iterations, relative residual ‖b − Kx‖/‖b‖."""

    method: dict[str, str]
    iterations: dict[str, int]
    residual: dict[str, float]

    @property
    def max_residual(self) -> float:
        return max(self.residual.values(), default=0.0)


class KFAC(Curvature):
    """Per-layer sums of Kronecker products, Σ_k A_k ⊗ G_k, as a curvature operator.

    Args:
        factors: module name → (A, G), or → a list of (A, G) terms (a lazy exact sum).
        bias: names of the modules whose A includes the bias as its last row/column.
        transposed: modules whose weight is stored as (in, out) — Hugging Face's GPT-2
            ``Conv1D`` and ``nn.Embedding`` (y = onehot(x) W) — and is transposed to (out, in).
        weight_shapes: the stored weight shape of modules whose weight is not a matrix, e.g. a
            ``Conv2d`` weight (out, in, kh, kw), which is viewed as (out, in·kh·kw).
        cg_tol: relative residual at which CG stops (more than two terms per layer); default
            1e-10 in float64, 1e-5 in float32.
        cg_maxiter: CG iterations before :class:`NotConvergedError`.
        counts: module name → M, the number of rows (kept positions, or examples) the layer's
            A is a mean over, as estimated (``KFACFactors.counts``); M·A = Σ a aᵀ is the raw
            input Gram that RegMean needs. Kept by ``to`` and ``scaled`` (they leave A alone),
            saved in curvature files; a sum of terms has no single M and keeps none.

    Example:
        >>> import torch, gradmerge as gm
        >>> A, G = torch.eye(3), 2 * torch.eye(2)           # one layer: weight (2, 2) + bias
        >>> K = gm.KFAC({"fc": (A, G)}, bias=["fc"])
        >>> x = {"fc.weight": torch.ones(2, 2), "fc.bias": torch.ones(2)}
        >>> (K + 2.0).solve(x)["fc.bias"]
        tensor([0.2500, 0.2500])
    """

    rank = 3

    def __init__(
        self,
        factors: Mapping[str, Term | list[Term]],
        *,
        bias: Iterable[str] = (),
        transposed: Iterable[str] = (),
        weight_shapes: Mapping[str, tuple[int, ...]] | None = None,
        cg_tol: float | None = None,
        cg_maxiter: int = 1000,
        counts: Mapping[str, int] | None = None,
    ) -> None:
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
        self.cg_tol, self.cg_maxiter = cg_tol, cg_maxiter
        self.last_solve: SolveInfo | None = None
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
        return self.solve_info(v)[0]

    def solve_info(self, v: Params) -> tuple[dict[str, Tensor], SolveInfo]:
        """The solution of K x = v, and how each layer's system was solved."""
        self.check_covers(v, name="the vector", ref_name="the vector")
        out: dict[str, Tensor] = {}
        method, iters, resid = {}, {}, {}
        for name, terms in self.terms.items():
            b = self._matrix(name, v)
            if len(terms) <= 2:
                x = self._direct(name, terms, b)
                method[name], iters[name] = f"{len(terms)}-term eigendecomposition", 0
            else:
                x, iters[name] = self._cg(name, terms, b)
                method[name] = f"{len(terms)}-term preconditioned CG"
            r = b - sum((g @ x @ a for a, g in terms), torch.zeros_like(b))
            bn = float(torch.linalg.norm(b))
            resid[name] = float(torch.linalg.norm(r)) / bn if bn > 0 else 0.0
            self._split(name, x, out)
        self.last_solve = SolveInfo(method, iters, resid)
        return out, self.last_solve

    # ----- exact solves for one or two Kronecker terms ------------------------------------------
    def _direct(self, name: str, terms: list[Term], b: Tensor) -> Tensor:
        key = f"{name}:direct"
        if key not in self._cache:
            self._cache[key] = _two_term_factorisation(name, terms)
        qa, qg, denom, (ta, tg) = self._cache[key]
        # K = (T_A ⊗ T_G)(Q_A ⊗ Q_G) diag(denom) (...)ᵀ: x = T_G⁻ᵀ... written with the factors:
        y = qg.T @ tg.T @ b @ ta @ qa
        return tg @ qg @ (y / denom) @ qa.T @ ta.T

    def _cg(self, name: str, terms: list[Term], b: Tensor) -> tuple[Tensor, int]:
        """CG preconditioned with :func:`_preconditioner` (exact Kronecker solves)."""
        key = f"{name}:cg"
        if key not in self._cache:
            self._cache[key] = _preconditioner(name, terms)
        parts = self._cache[key]

        def apply(v: Params) -> dict[str, Tensor]:
            return {"x": sum((g @ v["x"] @ a for a, g in terms), torch.zeros_like(v["x"]))}

        def precondition(v: Params) -> dict[str, Tensor]:
            out = torch.zeros_like(v["x"])
            for qa, qg, denom, (ta, tg) in parts:
                y = qg.T @ tg.T @ v["x"] @ ta @ qa
                out = out + tg @ qg @ (y / denom) @ qa.T @ ta.T
            return {"x": out}

        result = solve_or_raise(
            apply,
            {"x": b},
            precondition=precondition,
            tol=self.cg_tol,
            maxiter=self.cg_maxiter,
            what=f"the K-FAC system of {name!r}",
        )
        return result.x["x"], result.iterations

    # ----- algebra -------------------------------------------------------------------------
    def _new(self, terms: dict[str, list[Term]], *, keep_counts: bool = False) -> KFAC:
        return KFAC(
            terms,
            bias=self.bias,
            transposed=self.transposed,
            weight_shapes=self.weight_shapes,
            cg_tol=self.cg_tol,
            cg_maxiter=self.cg_maxiter,
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
        return self._new(
            {n: [(a, c * g) for a, g in t] for n, t in self.terms.items()}, keep_counts=True
        )

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
            eye_a = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
            terms[name] = [
                (eye_a, other.delta * torch.eye(g.shape[0], dtype=g.dtype, device=g.device))
            ]
        return self._new(terms)

    def min_eigenvalue(self) -> float:
        """The smallest eigenvalue: exact for one term per layer, and for two or more terms on
        layers of at most 4096 parameters (from the dense sum of Kronecker products); on larger
        layers with several terms, a lower bound (Weyl: the sum of the terms' minima)."""
        low = float("inf")
        for terms in self.terms.values():
            a0, g0 = terms[0]
            if len(terms) == 1:
                ea, eg = self._eigenvalues(a0), self._eigenvalues(g0)
                low = min(low, float(torch.outer(eg, ea).min()))
            elif a0.shape[0] * g0.shape[0] <= 4096:
                dense = sum(torch.kron(g, a) for a, g in terms)
                low = min(low, float(torch.linalg.eigvalsh(dense)[0]))
            else:
                bound = 0.0
                for a, g in terms:
                    ea, eg = self._eigenvalues(a), self._eigenvalues(g)
                    bound += float(torch.outer(eg, ea).min())
                low = min(low, bound)
        return low

    def _scale(self) -> float:
        """max over terms of ‖A‖₂‖G‖₂, from the factors' eigenvalues (symmetric factors: the
        largest |λ|), shared with :meth:`min_eigenvalue` — no singular value decomposition."""
        return max(
            float(self._eigenvalues(a).abs().max() * self._eigenvalues(g).abs().max())
            for t in self.terms.values()
            for a, g in t
        )

    def _eigenvalues(self, m: Tensor) -> Tensor:
        """:func:`_eigenvalues` of one of this operator's factors, computed once (a PSD check
        asks for them twice: the smallest eigenvalue, and the scale of its tolerance)."""
        key = f"eigenvalues/{id(m)}"
        if key not in self._cache:
            self._cache[key] = _eigenvalues(m)
        eigenvalues: Tensor = self._cache[key]
        return eigenvalues


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
        ca, cg = _identity_multiple(a), _identity_multiple(g)
        for i, (a_i, g_i) in enumerate(out):
            if cg is not None and (cg_i := _identity_multiple(g_i)) is not None:
                out[i] = (cg_i * a_i + cg * a, _eye_like(g))
                break
            if ca is not None and (ca_i := _identity_multiple(a_i)) is not None:
                out[i] = (_eye_like(a), ca_i * g_i + ca * g)
                break
        else:
            out.append((a, g))
    return out


def _eye_like(m: Tensor) -> Tensor:
    return torch.eye(m.shape[0], dtype=m.dtype, device=m.device)


def _preconditioner_terms(terms: list[Term]) -> list[Term]:
    r"""Two Kronecker terms P = A₀ ⊗ G₀ + Ā ⊗ Ḡ approximating K = Σ_{k=0}^{m} A_k ⊗ G_k (m ≥ 2),
    whose solve is exact (:func:`_two_term_factorisation`), for preconditioned CG.

    * The anchor A₀ ⊗ G₀ is the best-conditioned term, kept EXACTLY. In a merge that is the
      prior δ·I = I ⊗ δI (or δ·I folded into RegMean's A ⊗ I): its conditioning is 1.
    * The other m terms (the tasks) become one Kronecker product: the scale of each term is moved
      to one side, Â_k = A_k/‖A_k‖_F, Ĝ_k = ‖A_k‖_F G_k (so Â_k ⊗ Ĝ_k = A_k ⊗ G_k), and
      Ā ⊗ Ḡ = (Σ_k Â_k / m) ⊗ (Σ_k Ĝ_k) — or the same with the roles of A and G swapped,
      whichever side's normalised factors are more alike (larger least Frobenius cosine).

    Spectrum of P⁻¹K for PSD factors. Ā ⊗ Ḡ = S/m + C with S = Σ_k A_k ⊗ G_k and the PSD cross
    terms C = (1/m) Σ_{i≠j} Â_i ⊗ Ĝ_j. So:

    * K ⪯ m P, because S ⪯ (Σ_k Â_k) ⊗ (Σ_k Ĝ_k) = m Ā ⊗ Ḡ (the cross terms are PSD);
    * P ⪯ K + C ⪯ (1 + ρ) K, ρ = λ_max(K^{-1/2} C K^{-1/2}) ≤ ‖C‖ / λ_min(K) (≤ ‖C‖/δ with
      a prior δ·I);

    hence λ(P⁻¹K) ∈ [1/(1 + ρ), m] and κ(P⁻¹K) ≤ m (1 + ρ): ρ measures how differently the
    tasks' factors are shaped. When the averaged side is shared up to scale (Â_k all equal: tasks
    with the same input statistics at this layer, or the same output-gradient statistics),
    Ā ⊗ Ḡ = S exactly, P = K, and CG stops at its start x₀ = P⁻¹b.

    P alone degrades as the tasks' factors differ (ρ up to ‖C‖/δ): for δ·I + two tasks
    :func:`_preconditioner` adds the π-damped pair, whose bound does not depend on the tasks. The
    Frobenius-nearest Kronecker product of S measured the same as Ā ⊗ Ḡ on GPT-2 factors but can
    drop a task whose factors are orthogonal to the others' (weight 0), voiding K ⪯ m P.

    Example:
        >>> import torch
        >>> a, g1 = torch.diag(torch.tensor([2.0, 1.0])), torch.eye(2)
        >>> g2 = torch.tensor([[2.0, 1.0], [1.0, 2.0]])  # tasks sharing A up to scale: P = K
        >>> p = _preconditioner_terms([(torch.eye(2), 0.1 * torch.eye(2)), (a, g1), (3 * a, g2)])
        >>> torch.allclose(torch.kron(p[1][0], p[1][1]), torch.kron(a, g1) + torch.kron(3 * a, g2))
        True
    """
    anchor = max(range(len(terms)), key=lambda i: _conditioning(terms[i]))
    rest = [t for i, t in enumerate(terms) if i != anchor]
    swap = _least_cosine([g for _, g in rest]) > _least_cosine([a for a, _ in rest])
    if swap:  # average the G side: Ā ⊗ Ḡ = (Σ_k Ǎ_k) ⊗ (Σ_k Ğ_k / m)
        rest = [(g, a) for a, g in rest]
    norms = [float(torch.linalg.matrix_norm(a)) for a, _ in rest]
    keep = [(a / n, n * g) for (a, g), n in zip(rest, norms, strict=True) if n > 0]
    if not keep:  # every other term is zero
        keep = rest[:1]
    x_bar = sum((a for a, _ in keep), torch.zeros_like(keep[0][0])) / len(keep)
    y_bar = sum((g for _, g in keep), torch.zeros_like(keep[0][1]))
    return [terms[anchor], (y_bar, x_bar) if swap else (x_bar, y_bar)]


def _least_cosine(ms: list[Tensor]) -> float:
    """min over pairs of ⟨M_i, M_j⟩_F / (‖M_i‖_F ‖M_j‖_F) (1 for identical shapes up to scale)."""
    flat = torch.stack([m.reshape(-1) for m in ms])
    n = torch.linalg.vector_norm(flat, dim=1).clamp_min(torch.finfo(flat.dtype).tiny)
    return float(((flat @ flat.T) / torch.outer(n, n)).min())


def _pi_damped_terms(terms: list[Term]) -> list[Term] | None:
    r"""For K = δ·I + A₁ ⊗ G₁ + A₂ ⊗ G₂ (δ·I being a term I ⊗ δI), the π-damped pair
    P_π = Σ_k (A_k + π_k s I) ⊗ (G_k + s/π_k I), s = √(δ/2), π_k² = (tr A_k/n_A)/(tr G_k/n_G)
    (Martens & Grosse 2015); None for any other shape of K.

    Each term satisfies A ⊗ G + s² I ⪯ (A + πsI) ⊗ (G + s/π I) ⪯ r (A ⊗ G + s² I), with r the
    largest (a + πs)(g + s/π)/(ag + s²) over the eigenvalues a of A and g of G (the factors
    commute with the identity). So λ(P_π⁻¹K) ∈ [1/r_max, 1], whatever the tasks' eigenbases.
    """
    if len(terms) != 3:
        return None
    ident = [i for i, (a, g) in enumerate(terms) if _identity_multiple(a) is not None]
    ident = [i for i in ident if _identity_multiple(terms[i][1]) is not None]
    if len(ident) != 1:
        return None
    a0, g0 = terms[ident[0]]
    delta = float(a0[0, 0]) * float(g0[0, 0])
    if delta <= 0:
        return None
    s = (delta / 2) ** 0.5
    out = []
    for i, (a, g) in enumerate(terms):
        if i == ident[0]:
            continue
        ta, tg = float(a.trace()) / a.shape[0], float(g.trace()) / g.shape[0]
        if ta <= 0 or tg <= 0:
            return None
        pi = (ta / tg) ** 0.5
        out.append((a + pi * s * _eye_like(a), g + (s / pi) * _eye_like(g)))
    return out


def _preconditioner(name: str, terms: list[Term]) -> list[tuple[Tensor, Tensor, Tensor, tuple]]:
    r"""The factorised preconditioner M⁻¹ = Σ_j P_j⁻¹, each P_j two Kronecker terms solved exactly.

    * P_a of :func:`_preconditioner_terms` always: λ(P_a⁻¹K) ∈ [1/(1 + ρ), m].
    * For δ·I + two tasks, also P_π of :func:`_pi_damped_terms`: λ(P_π⁻¹K) ∈ [1/r_max, 1].
      M⁻¹K = P_a⁻¹K + P_π⁻¹K is self-adjoint in the K inner product and each summand is PSD
      there, so its Rayleigh quotients are at least the sum of the two minima and at most the
      sum of the maxima: λ(M⁻¹K) ∈ [1/(1 + ρ) + 1/r_max, m + 1], so
      κ(M⁻¹K) ≤ 3 · min(1 + ρ, r_max). P_a is the better one when the tasks' factors are alike
      (ρ small; P_a = K when one side is shared up to scale), P_π when they are unrelated (ρ
      up to ‖C‖/δ, while r_max grows like √(‖A‖‖G‖/δ)). Measured (benchmarks/kfac_solve.py):
      on GPT-2 factors P_π alone needs 3–20× the iterations of P_a; on random factors with
      unrelated eigenbases P_a alone does not converge in 2000 iterations at δ = 1e-6 relative;
      the sum needs at most ~1.5× the iterations of the better of the two, for one more
      two-term solve per iteration and a second factorisation.

    When the anchor of P_a is not positive definite (e.g. no damping and every factor singular),
    the one term (Σ_k A_k / K) ⊗ (Σ_k G_k) with its small eigenvalues clamped. All are SPD; CG
    checks the real system.
    """
    try:
        parts = [_two_term_factorisation(name, _preconditioner_terms(terms), preconditioner=True)]
    except NotPositiveDefiniteError:
        mean_a = sum((a for a, _ in terms), torch.zeros_like(terms[0][0])) / len(terms)
        sum_g = sum((g for _, g in terms), torch.zeros_like(terms[0][1]))
        return [_two_term_factorisation(name, [(mean_a, sum_g)], preconditioner=True)]
    pi_terms = _pi_damped_terms(terms)
    if pi_terms is not None:
        parts.append(_two_term_factorisation(name, pi_terms, preconditioner=True))
    return parts


def _eigenvalues(m: Tensor) -> Tensor:
    """Eigenvalues of the symmetric factor ``m``, ascending; read off for c·I (RegMean's G,
    δ·I's factors) instead of an eigendecomposition."""
    c = _identity_multiple(m)
    return torch.full_like(m[0], c) if c is not None else torch.linalg.eigvalsh(m)


def _identity_multiple(g: Tensor) -> float | None:
    """c if G = c·I exactly, else None."""
    c = float(g[0, 0])
    return c if torch.equal(g, c * torch.eye(g.shape[0], dtype=g.dtype, device=g.device)) else None


def _sym_eig(m: Tensor) -> tuple[Tensor, Tensor]:
    """Eigendecomposition of the symmetric part of ``m``, computed on ``m`` scaled to unit size
    (LAPACK can fail to converge on matrices of subnormal numbers, e.g. δ·I with a tiny δ)."""
    sym = (m + m.T) / 2
    scale = sym.abs().max()
    if not bool(scale > 0):
        return torch.linalg.eigh(sym)
    lam, q = torch.linalg.eigh(sym / scale)
    return lam * scale, q


def _two_term_factorisation(
    name: str, terms: list[Term], *, preconditioner: bool = False
) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor]]:
    """Diagonalise A₁ ⊗ G₁ (+ A₂ ⊗ G₂) as (T_A Q_A ⊗ T_G Q_G)⁻ᵀ diag(denom) (...)⁻¹.

    One term: T = I, Q the eigenvectors, denom = λ_G λ_Aᵀ. Two terms: with A₁ = L_A L_Aᵀ (L from
    the eigendecomposition, pseudo-inverse-free: A₁ must be PD), T_A = L_A⁻ᵀ, and Q_A the
    eigenvectors of T_Aᵀ A₂ T_A (likewise G): denom = 1 + μ_G μ_Aᵀ. The solve is
    x = T_G Q_G [(Q_Gᵀ T_Gᵀ b T_A Q_A) / denom] Q_Aᵀ T_Aᵀ.

    A system is numerically singular when its smallest eigenvalue is below max(n_A, n_G, 10)·ε
    times its largest (the size of round-off in eigenvalues of an n × n matrix). As a CG
    preconditioner (``preconditioner=True``) the operator only needs to be positive: small
    eigenvalues are clamped to that floor instead of refused (CG checks the real system).
    """
    if len(terms) == 1:
        (a, g) = terms[0]
        la, qa = _sym_eig(a)
        lg, qg = _sym_eig(g)
        denom = torch.outer(lg, la)
        eye_a = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
        eye_g = torch.eye(g.shape[0], dtype=g.dtype, device=g.device)
        trans = (eye_a, eye_g)
    elif len(terms) == 2:
        # the better-conditioned term defines the metric (it must be positive definite), unless
        # it is negligible next to the other (a tiny δ·I): its inverse would overflow
        ordered = sorted(terms, key=_conditioning, reverse=True)
        size_of = [float(a.abs().max()) * float(g.abs().max()) for a, g in ordered]
        tiny = size_of[0] < torch.finfo(ordered[0][0].dtype).eps * size_of[1]
        if tiny and _conditioning(ordered[1]) > 0:
            ordered.reverse()
        (a1, g1), (a2, g2) = ordered
        # factors scaled to unit size (s_A, s_G): T_Aᵀ A₁ T_A = s_A I, so denom carries s_A s_G
        sa, sg = a1.abs().max(), g1.abs().max()
        ta, tg = _inv_sqrt(name, a1 / sa), _inv_sqrt(name, g1 / sg)
        ma, qa = _sym_eig(ta.T @ (a2 / sa) @ ta)
        mg, qg = _sym_eig(tg.T @ (g2 / sg) @ tg)
        denom = (sa * sg) * (1.0 + torch.outer(mg, ma))
        trans = (ta, tg)
    else:  # pragma: no cover - callers dispatch
        raise ArgumentError("direct K-FAC solves take one or two terms")
    scale = float(denom.abs().max())
    size = max(denom.shape[0], denom.shape[1], 10)
    floor = size * torch.finfo(denom.dtype).eps * max(scale, 1e-300)
    if preconditioner:
        return qa, qg, denom.clamp(min=floor), trans
    if float(denom.min()) <= floor:
        raise not_pd(
            f"K-FAC system of {name!r}",
            f"smallest eigenvalue {float(denom.min()):.3e}, not above the round-off floor "
            f"{floor:.3e} of a system whose largest is {scale:.3e}",
            delta=10 * floor,
        )
    return qa, qg, denom, trans


def _conditioning(term: Term) -> float:
    """λ_min/λ_max of A ⊗ G (≤ 0 when a factor is singular or indefinite)."""
    ea, eg = (torch.linalg.eigvalsh((m + m.T) / 2) for m in term)
    top = float(ea.abs().max() * eg.abs().max())
    return float(ea[0] * eg[0]) / top if ea[0] > 0 and eg[0] > 0 and top > 0 else -1.0


def _inv_sqrt(name: str, m: Tensor) -> Tensor:
    """T with Tᵀ M T = I, from the eigendecomposition of the SPD matrix M."""
    lam, q = _sym_eig(m)
    if float(lam.min()) <= 0:
        raise not_pd(
            f"K-FAC factor of {name!r}",
            f"smallest eigenvalue {float(lam.min()):.3e}; a two-term solve needs the first "
            "term's factors positive definite (damping δ makes the I ⊗ δI term a good first term)",
        )
    return q / lam.sqrt()
