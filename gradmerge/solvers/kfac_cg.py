r"""δ·I plus Kronecker products, per layer: K = δ I + Σ_k A_k ⊗ G_k, solved to a certified residual.

This is the system of every K-FAC merge with a prior (Eq. 6: H̄ = δI + Σ_t α_t A_t ⊗ G_t) and
of every K-FAC removal. The layer's unknown is the matrix X = [V | b]; K acts as
X ↦ δX + Σ_k G_k X A_k.

Method (eigenbasis-preconditioned CG, in the spirit of EKFAC, George et al. 2018):

1. A common eigenbasis. For one term, the eigenvectors Q_A, Q_G of its own factors; for more,
   those of the collapsed factors Ā = Σ_k A_k/‖A_k‖_F and Ḡ = Σ_k ‖A_k‖_F G_k (each term's
   scale moved to its G side). Each factor's decomposition is computed once per process
   (:func:`gradmerge.solvers.kronecker.eigh`).
2. In that basis each term is Ã_k ⊗ G̃_k with Ã_k = Q_Aᵀ A_k Q_A, G̃_k = Q_Gᵀ G_k Q_G, and the
   diagonal of K is exactly D = δ + Σ_k diag(G̃_k) diag(Ã_k)ᵀ (the diagonal of a Kronecker
   product is the Kronecker product of the diagonals). One term: K̃ = D, and y = b̃ / D is the
   exact solution. More terms: CG on K̃ y = b̃ preconditioned by D⁻¹ (Jacobi in the common
   eigenbasis), starting from D⁻¹ b̃. When the tasks' factors share eigenvectors, D = K̃ and CG
   stops at its start; in general D⁻¹ is as good a preconditioner as the exact solve of
   δI + Ā ⊗ Ḡ and far cheaper (no second factorisation, one diagonal scaling per iteration).
3. Certification. The relative residual ‖b − K x‖/‖b‖ is recomputed in the ORIGINAL basis, in
   float64 when the working dtype is coarser (the residual of a float32 solve then measures the
   solution, not float32's round-off in forming it). Above ``tol``, the correction of K e = r is
   solved the same way and added (iterative refinement: each round gains about the working
   precision's accuracy), up to :data:`REFINEMENTS` rounds; otherwise
   :class:`NotConvergedError`.

Working precision: the eigendecompositions and CG run in the factors' dtype (float32 factors are
decomposed in float32: their eigenvectors only define the basis; any loss of orthogonality is a
preconditioner error that step 3 measures and removes).

References:
    Martens & Grosse, "Optimizing neural networks with Kronecker-factored approximate
    curvature", ICML 2015. George et al., "Fast approximate natural gradient descent in a
    Kronecker-factored eigenbasis", NeurIPS 2018.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from gradmerge.errors import NotConvergedError, NotPositiveDefiniteError
from gradmerge.solvers.cg import default_tol
from gradmerge.solvers.kronecker import Term, eigh, identity_multiple

REFINEMENTS = 5
"""Rounds of iterative refinement after the first solve (each one a solve of K e = r)."""

INNER_RTOL = 1e-3
"""Relative accuracy of each refinement's correction solve."""


@dataclass(frozen=True)
class LayerSolve:
    """One layer's solve: x, how, CG iterations, the certified relative residual, and whether
    it met the tolerance (False only for an ``approximate`` solve that stopped above it)."""

    x: Tensor
    method: str
    iterations: int
    residual: float
    success: bool = True


def split_identity(terms: list[Term]) -> tuple[float, list[Term]]:
    """(δ, the other terms) for Σ_k A_k ⊗ G_k whose terms c_A I ⊗ c_G I add up to δ·I."""
    delta, rest = 0.0, []
    for a, g in terms:
        ca, cg = identity_multiple(a), identity_multiple(g)
        if ca is not None and cg is not None:
            delta += ca * cg
        else:
            rest.append((a, g))
    return delta, rest


def solve(
    name: str,
    delta: float,
    terms: list[Term],
    b: Tensor,
    *,
    tol: float | None = None,
    maxiter: int = 1000,
    approximate: bool = False,
) -> LayerSolve:
    """Solve (δI + Σ_k A_k ⊗ G_k) X = B for one layer (see the module docstring).

    Args:
        name: the layer, for messages.
        delta: δ ≥ 0 (δ = 0 needs the terms' sum to be positive definite).
        terms: (A_k, G_k), at least one, PSD factors of one dtype and device.
        b: B, (out × in[+1]).
        tol: relative residual to certify; default 1e-10 in float64, 1e-5 in float32.
        maxiter: CG iterations per round before :class:`NotConvergedError`.
        approximate: stop after at most ``maxiter`` CG iterations (0: the preconditioner's
            solve D⁻¹ in the common eigenbasis alone, which is exact for one term) and return
            that x with its measured residual, above ``tol`` or not: no refinement, no float64
            fallback, no :class:`NotConvergedError`. An explicit speed-for-accuracy trade; the
            residual is still certified in float64 and reported.

    Raises:
        NotConvergedError: the residual stays above ``tol`` after CG and refinement (not with
            ``approximate``).
        NotPositiveDefiniteError: K is singular or indefinite (CG met pᵀKp ≤ 0, or D has a
            non-positive entry).

    Example:
        >>> import torch
        >>> a1, g1 = torch.diag(torch.tensor([2.0, 1.0])), torch.eye(3)
        >>> a2, g2 = torch.ones(2, 2), torch.diag(torch.tensor([1.0, 2.0, 3.0]))
        >>> b = torch.ones(3, 2)
        >>> s = solve("fc", 0.5, [(a1, g1), (a2, g2)], b)
        >>> dense = 0.5 * torch.eye(6) + torch.kron(g1, a1) + torch.kron(g2, a2)
        >>> torch.allclose(s.x.reshape(-1), torch.linalg.solve(dense, b.reshape(-1)), atol=1e-5)
        True
    """
    tol = default_tol(b.dtype) if tol is None else tol
    bnorm = float(torch.linalg.norm(b.to(torch.float64)))
    if bnorm == 0:
        return LayerSolve(torch.zeros_like(b), "zero right-hand side", 0, 0.0)
    if not terms:  # δ·I alone
        if not delta > 0:
            raise NotPositiveDefiniteError(
                f"the K-FAC system of {name!r} is δ·I with δ = {delta:.3e}: add a prior δ > 0"
            )
        return LayerSolve(b / delta, "δ·I (exact)", 0, 0.0)
    basis = _Basis(name, delta, terms)
    target = tol * bnorm / 2  # CG aims below tol: the certified residual has room for round-off
    x, iterations = basis.solve(b, target, maxiter)
    r = residual(delta, terms, b, x)
    rel = float(torch.linalg.norm(r)) / bnorm
    if approximate:  # the explicit trade: x as it stands, its residual measured
        met = rel <= tol
        note = "" if met else f", approximate: stopped after {iterations} CG iterations"
        return LayerSolve(x, basis.method + note, iterations, rel, met)
    rounds = 0
    while rel > tol and rounds < REFINEMENTS:
        rounds += 1
        # the correction to INNER_RTOL of its own right-hand side r: each round divides the
        # residual by about 1/INNER_RTOL, until the working dtype's round-off in forming K e
        rhs = r.to(b.dtype)
        inner = min(target, INNER_RTOL * float(torch.linalg.norm(rhs)))
        e, its = basis.solve(rhs, inner, maxiter)
        x, iterations = x + e, iterations + its
        r = residual(delta, terms, b, x)
        rel = float(torch.linalg.norm(r)) / bnorm
    method = basis.method + (f", {rounds} refinement(s)" if rounds else "")
    if rel > tol and b.dtype != torch.float64:
        # the working dtype cannot resolve this system (κ·ε ≳ tol): solve it in float64; the
        # residual certified is the float64 solution's, and the method says what rounding it to
        # the working dtype (as the merged tensors will be) leaves
        wide = [(a.to(torch.float64), g.to(torch.float64)) for a, g in terms]
        exact = solve(name, delta, wide, b.to(torch.float64), tol=tol, maxiter=maxiter)
        x, iterations, rel = exact.x.to(b.dtype), iterations + exact.iterations, exact.residual
        rounded = float(torch.linalg.norm(residual(delta, terms, b, x))) / bnorm
        dtype = str(b.dtype).removeprefix("torch.")
        method = f"{exact.method}, in float64 (rounded to {dtype}: residual {rounded:.1e})"
    if rel > tol:
        raise not_converged(
            name, rel, tol, b.dtype, f"{iterations} CG iterations, {rounds} refinements"
        )
    return LayerSolve(x, method, iterations, rel)


def not_converged(
    name: str, residual: float, tol: float, dtype: torch.dtype, how: str
) -> NotConvergedError:
    """The error for a layer whose certified residual stays above ``tol``."""
    return NotConvergedError(
        f"the K-FAC system of {name!r} was solved only to relative residual {residual:.2e} "
        f"(tol {tol:.0e}, {str(dtype).removeprefix('torch.')}) after {how}: it is too "
        "ill-conditioned for this precision — raise the prior δ (`prior: {delta: ...}`), or "
        "compute in float64"
    )


class _Basis:
    """The common eigenbasis of a layer's terms, the rotated terms and the diagonal D."""

    def __init__(self, name: str, delta: float, terms: list[Term]) -> None:
        self.name, self.delta = name, delta
        if len(terms) == 1:
            a0, g0 = terms[0]
            la, self.qa = eigh(a0)
            lg, self.qg = eigh(g0)
            self.rotated: list[Term] = []
            self.diagonal = delta + torch.outer(lg, la)  # K̃ = D exactly
            self.method = "eigenbasis (exact)"
        else:
            norms = [torch.linalg.matrix_norm(a) for a, _ in terms]
            norms = [n if bool(n > 0) else torch.ones_like(n) for n in norms]
            pairs = list(zip(terms, norms, strict=True))
            a0 = sum((a / n for (a, _), n in pairs), torch.zeros_like(terms[0][0]))
            g0 = sum((n * g for (_, g), n in pairs), torch.zeros_like(terms[0][1]))
            self.qa, self.qg = eigh(a0)[1], eigh(g0)[1]
            self.rotated = [(self.qa.T @ a @ self.qa, self.qg.T @ g @ self.qg) for a, g in terms]
            self.diagonal = delta + sum(
                (torch.outer(g.diagonal(), a.diagonal()) for a, g in self.rotated),
                torch.zeros_like(terms[0][1][:, :1] * terms[0][0][:1]),
            )
            prior = " + δI" if delta else ""
            self.method = f"eigenbasis-preconditioned CG ({len(terms)} Kronecker terms{prior})"
        low = float(self.diagonal.min())
        if not low > 0:
            raise NotPositiveDefiniteError(
                f"the K-FAC system of {name!r} is not positive definite: its diagonal in the "
                f"factors' eigenbasis has an entry {low:.3e}; add a prior δ > 0 "
                "(`prior: {delta: ...}`)"
            )

    def solve(self, b: Tensor, target: float, maxiter: int) -> tuple[Tensor, int]:
        """x ≈ K⁻¹ b: exact for one term; for more, CG until ‖b − Kx‖ ≤ ``target``."""
        bt = self.qg.T @ b @ self.qa
        if not self.rotated:
            return self.qg @ (bt / self.diagonal) @ self.qa.T, 0
        y, its = _pcg(self._apply, bt, self.diagonal, target, maxiter, self.name)
        return self.qg @ y @ self.qa.T, its

    def _apply(self, y: Tensor) -> Tensor:
        out = self.delta * y
        for a, g in self.rotated:
            out = out + g @ y @ a
        return out


def _pcg(
    apply: Callable[[Tensor], Tensor],
    b: Tensor,
    diagonal: Tensor,
    target: float,
    maxiter: int,
    name: str,
) -> tuple[Tensor, int]:
    """Jacobi-preconditioned CG until the recursive residual is at most ``target`` (absolute);
    the caller certifies the true residual."""
    x = b / diagonal
    r = b - apply(x)
    z = r / diagonal
    p, rz = z, float((r * z).sum())
    for k in range(maxiter):
        if float(torch.linalg.norm(r)) <= target:
            return x, k
        q = apply(p)
        pq = float((p * q).sum())
        if not pq > 0:
            raise NotPositiveDefiniteError(
                f"the K-FAC system of {name!r} is not positive definite: CG met a direction "
                f"with pᵀKp = {pq:.3e}; add a prior δ > 0 (`prior: {{delta: ...}}`)"
            )
        step = rz / pq
        x = x + step * p
        r = r - step * q
        z = r / diagonal
        rz_next = float((r * z).sum())
        p = z + (rz_next / rz) * p
        rz = rz_next
    return x, maxiter


def residual(delta: float, terms: list[Term], b: Tensor, x: Tensor) -> Tensor:
    """b − K x in the original basis, in float64 (or the working dtype if wider)."""
    wide = torch.promote_types(b.dtype, torch.float64)
    xw = x.to(wide)
    out = b.to(wide) - delta * xw
    for a, g in terms:
        out = out - g.to(wide) @ xw @ a.to(wide)
    return out
