"""K-FAC curvature: per layer a (lazy, exact) sum of Kronecker products Σ_k A_k ⊗ G_k.

Convention (DESIGN.md): a layer ``m`` with weight V of shape (out, in) — the ``nn.Linear``
layout — and optionally a bias is treated as one matrix [V | b] of shape (out, in + 1), the bias
being the LAST input column. A term A ⊗ G acts as [V | b] ↦ G [V | b] A, with A (in[+1])² and G
out². The operator covers ``f"{m}.weight"`` and, for layers in ``bias``, ``f"{m}.bias"``.

Sums stay exact: ``K1 + K2`` keeps both Kronecker terms per layer (it never sums the factors,
which would be a different, approximate operator); ``K + δ`` adds the term I ⊗ δI. Solves:

- one term: eigendecompositions of A and G, exactly;
- two terms: a simultaneous diagonalisation (A₂ in the A₁-metric, G₂ in the G₁-metric), exactly;
- more terms: conjugate gradients preconditioned with the two-term solve of
  (Σ_k A_k/K) ⊗ (Σ_k G_k) — reported in ``solve_info`` and raising if it does not converge.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from gradmerge import params as P
from gradmerge.curvature.base import Curvature, IncompatibleStructures, not_pd
from gradmerge.curvature.identity import ScaledIdentity
from gradmerge.errors import ArgumentError, StructureError
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
    ) -> None:
        if not factors:
            raise StructureError("KFAC needs factors for at least one module")
        self.bias, self.transposed = frozenset(bias), frozenset(transposed)
        self.weight_shapes = {k: tuple(v) for k, v in (weight_shapes or {}).items()}
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
        self._cache: dict[str, tuple] = {}

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
        """CG preconditioned with the exact solve of (Σ_k A_k / K) ⊗ (Σ_k G_k)."""
        mean_a = sum((a for a, _ in terms), torch.zeros_like(terms[0][0])) / len(terms)
        sum_g = sum((g for _, g in terms), torch.zeros_like(terms[0][1]))
        qa, qg, denom, (ta, tg) = _two_term_factorisation(
            name, [(mean_a, sum_g)], preconditioner=True
        )

        def apply(v: Params) -> dict[str, Tensor]:
            return {"x": sum((g @ v["x"] @ a for a, g in terms), torch.zeros_like(v["x"]))}

        def precondition(v: Params) -> dict[str, Tensor]:
            y = qg.T @ tg.T @ v["x"] @ ta @ qa
            return {"x": tg @ qg @ (y / denom) @ qa.T @ ta.T}

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
    def _new(self, terms: dict[str, list[Term]]) -> KFAC:
        return KFAC(
            terms,
            bias=self.bias,
            transposed=self.transposed,
            weight_shapes=self.weight_shapes,
            cg_tol=self.cg_tol,
            cg_maxiter=self.cg_maxiter,
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
            }
        )

    def scaled(self, c: float) -> KFAC:
        return self._new({n: [(a, c * g) for a, g in t] for n, t in self.terms.items()})

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
                ea, eg = torch.linalg.eigvalsh(a0), torch.linalg.eigvalsh(g0)
                low = min(low, float(torch.outer(eg, ea).min()))
            elif a0.shape[0] * g0.shape[0] <= 4096:
                dense = sum(torch.kron(g, a) for a, g in terms)
                low = min(low, float(torch.linalg.eigvalsh(dense)[0]))
            else:
                bound = 0.0
                for a, g in terms:
                    ea, eg = torch.linalg.eigvalsh(a), torch.linalg.eigvalsh(g)
                    bound += float(torch.outer(eg, ea).min())
                low = min(low, bound)
        return low

    def _scale(self) -> float:
        return max(
            float(torch.linalg.matrix_norm(a, 2) * torch.linalg.matrix_norm(g, 2))
            for t in self.terms.values()
            for a, g in t
        )


def _combine(terms: list[Term], extra: list[Term]) -> list[Term]:
    """``terms + extra``, merging exactly the terms whose G factors are multiples of one another's
    identity: A₁ ⊗ c₁I + A₂ ⊗ c₂I = (c₁A₁ + c₂A₂) ⊗ I (RegMean's case, and δ·I with such terms).
    Any other pair stays a separate Kronecker term (summing factors would be approximate)."""
    out = list(terms)
    for a, g in extra:
        c = _identity_multiple(g)
        for i, (a_i, g_i) in enumerate(out):
            c_i = _identity_multiple(g_i)
            if c is not None and c_i is not None:
                out[i] = (c_i * a_i + c * a, torch.eye(g.shape[0], dtype=g.dtype, device=g.device))
                break
        else:
            out.append((a, g))
    return out


def _identity_multiple(g: Tensor) -> float | None:
    """c if G = c·I exactly, else None."""
    c = float(g[0, 0])
    return c if torch.equal(g, c * torch.eye(g.shape[0], dtype=g.dtype, device=g.device)) else None


def _sym_eig(m: Tensor) -> tuple[Tensor, Tensor]:
    return torch.linalg.eigh((m + m.T) / 2)


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
        # the better-conditioned term defines the metric (it must be positive definite)
        (a1, g1), (a2, g2) = sorted(terms, key=_conditioning, reverse=True)
        ta, tg = _inv_sqrt(name, a1), _inv_sqrt(name, g1)
        ma, qa = _sym_eig(ta.T @ a2 @ ta)
        mg, qg = _sym_eig(tg.T @ g2 @ tg)
        denom = 1.0 + torch.outer(mg, ma)
        trans = (ta, tg)
    else:  # pragma: no cover - callers dispatch
        raise ArgumentError("direct K-FAC solves take one or two terms")
    scale = float(denom.abs().max())
    size = max(denom.shape[0], denom.shape[1], 10)
    floor = size * torch.finfo(denom.dtype).eps * max(scale, 1e-300)
    if preconditioner:
        return qa, qg, denom.clamp(min=floor), trans
    if float(denom.min()) <= floor:
        raise not_pd(f"K-FAC system of {name!r}", f"smallest eigenvalue {float(denom.min()):.3e}")
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
