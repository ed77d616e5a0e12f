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

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from gradmerge.errors import NotConvergedError, NotPositiveDefiniteError, not_pd
from gradmerge.solvers.cg import default_tol
from gradmerge.solvers.kronecker import Term, eigh, identity_multiple
from gradmerge.solvers.spec import ArithmeticMode, KroneckerCG

REFINEMENTS = 5
"""Rounds of iterative refinement after the first solve (each one a solve of K e = r)."""

INNER_RTOL = 1e-3
"""Relative accuracy of each refinement's correction solve."""

LOW_RTOL = 1e-2
"""Relative accuracy of each bfloat16-product CG round (``arithmetic="bfloat16"``), against the
residual formed in the working dtype."""

DROP = 1e-3
"""A low-rank reduction leaves out factor directions whose eigenvalue is below
DROP · δ / Σ_k ‖A_k‖‖G_k‖ of the largest: what that leaves of K is at most about DROP·δ, so
each refinement round divides the residual by about 1/DROP."""

NOISE = 32
"""Directions of a factor below NOISE·ε (its dtype's) of the largest are rounding, not range."""

MIN_SIDE = 128
"""Sides smaller than this are never reduced (their whole solve is cheap)."""

SMALL = 256 * 256
"""Reduced systems of at most this many unknowns are solved with one intra-op thread."""

LOW_MIN_SIDE = 256
"""``arithmetic="auto"`` uses bfloat16 products only where both sides of a layer are at least
this long (smaller products gain nothing and pay the conversions)."""

MAX_RANK = 512
"""The largest joint factor rank a low-rank reduction looks for (its pivoted Cholesky costs
n·r²); sides of a larger or more than half-full range are solved whole."""


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
    spec: KroneckerCG | None = None,
    *,
    x0: Tensor | None = None,
    reduce: bool = True,
) -> LayerSolve:
    """Solve (δI + Σ_k A_k ⊗ G_k) X = B for one layer (see the module docstring).

    Args:
        name: the layer, for messages.
        delta: δ ≥ 0 (δ = 0 needs the terms' sum to be positive definite).
        terms: (A_k, G_k), at least one, PSD factors of one dtype and device.
        b: B, (out × in[+1]).
        spec: the solver, a :class:`KroneckerCG` (default ``KroneckerCG()``): ``tol``, the
            relative residual to certify (default: by the dtype,
            :data:`gradmerge.solvers.spec.DEFAULT_TOL`); ``maxiter``, CG iterations per
            round before :class:`NotConvergedError`; ``approximate``, stop after at most
            ``maxiter`` CG iterations (0: the preconditioner's solve D⁻¹ in the common
            eigenbasis alone, which is exact for one term) and return that x with its measured
            residual, above ``tol`` or not: no refinement, no float64 fallback, no
            :class:`NotConvergedError` (an explicit speed-for-accuracy trade; the residual is
            still certified in float64 and reported); ``arithmetic``, the dtype of CG's inner
            Kronecker products (``"bfloat16"``: under a working-precision refinement, same
            certificate; ``"auto"``: :func:`auto_arithmetic`); ``warm_start``, whether ``x0`` may
            start CG.
        x0: an estimate of X; CG starts from it when its residual is below that of the
            preconditioner's solve (both measured in the eigenbasis).
        reduce: allow the low-rank reduction (:class:`LowRank`); where its refinement does not
            reach ``tol``, the layer is solved again without it.

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
    spec = KroneckerCG() if spec is None else spec
    tol = default_tol(b.dtype) if spec.tol is None else spec.tol
    maxiter = spec.maxiter
    assert maxiter is not None  # KroneckerCG resolves its default
    bnorm = float(torch.linalg.norm(b.to(torch.float64)))
    if bnorm == 0:
        return LayerSolve(torch.zeros_like(b), "zero right-hand side", 0, 0.0)
    if not terms:  # δ·I alone
        if not delta > 0:
            raise not_pd(f"the K-FAC system of {name!r}", f"δ·I with δ = {delta:.3e}")
        return LayerSolve(b / delta, "δ·I (exact)", 0, 0.0)
    basis = inverse(name, delta, terms, spec.arithmetic, reduce)
    target = tol * bnorm / 2  # CG aims below tol: the certified residual has room for round-off
    x, iterations = basis.solve(b, target, maxiter, x0 if spec.warm_start else None)
    r = residual(delta, terms, b, x)
    rel = float(torch.linalg.norm(r)) / bnorm
    if spec.approximate:  # the explicit trade: x as it stands, its residual measured
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
    if rel > tol and isinstance(basis, LowRank):  # it left out too much of K: the whole solve
        whole = solve(name, delta, terms, b, spec, x0=x0, reduce=False)
        return dataclasses.replace(whole, iterations=iterations + whole.iterations)
    if rel > tol and b.dtype != torch.float64:
        # the working dtype cannot resolve this system (κ·ε ≳ tol): solve it in float64; the
        # residual certified is the float64 solution's, and the method says what rounding it to
        # the working dtype (as the merged tensors will be) leaves
        wide = [(a.to(torch.float64), g.to(torch.float64)) for a, g in terms]
        exact = solve(name, delta, wide, b.to(torch.float64), KroneckerCG(tol, maxiter))
        x, iterations, rel = exact.x.to(b.dtype), iterations + exact.iterations, exact.residual
        rounded = float(torch.linalg.norm(residual(delta, terms, b, x))) / bnorm
        dtype = str(b.dtype).removeprefix("torch.")
        method = f"{exact.method}, in float64 (rounded to {dtype}: residual {rounded:.1e})"
    if rel > tol:
        raise not_converged(
            name, rel, tol, b.dtype, f"{iterations} CG iterations, {rounds} refinements"
        )
    return LayerSolve(x, method, iterations, rel)


def inverse(
    name: str, delta: float, terms: list[Term], arithmetic: ArithmeticMode, reduce: bool = True
) -> Inverse:
    """The approximate inverse of one layer's K that :func:`solve` refines: the exact solve of
    K restricted to the joint range of its factors where that range is small
    (:class:`LowRank`, with ``reduce``), else CG in the common eigenbasis (:class:`Basis`)."""
    if delta > 0 and reduce:
        reduced = LowRank.build(name, delta, terms)
        if reduced is not None:
            return reduced
    return Basis(name, delta, terms, arithmetic)


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


class Inverse(Protocol):
    """x ≈ K⁻¹ b for one layer, to an absolute residual target (the caller certifies)."""

    method: str

    def solve(
        self, b: Tensor, target: float, maxiter: int, x0: Tensor | None = None
    ) -> tuple[Tensor, int]: ...


class Basis:
    """The common eigenbasis of a layer's terms, the rotated terms and the diagonal D.

    With ``arithmetic="bfloat16"`` (and several terms; ``"auto"``: where :func:`auto_arithmetic`
    says so), CG's Kronecker products run in bfloat16
    (AMX/tensor-core GEMMs with float32 accumulation) inside a refinement whose residual
    b̃ − K̃ỹ is formed with the working-dtype rotated terms: each round solves K̃ e = r with
    bfloat16 products to :data:`LOW_RTOL` of ‖r‖ and adds e. A round that does not halve the
    residual (bfloat16's error times the system's conditioning near 1) hands the rest to
    working-precision CG from where it stands, so the result and its certificate are those of
    the working-precision solve, reached with fewer working-precision products. Where bfloat16's
    rounding makes CG meet pᵀK̃p ≤ 0 (δ small against the terms), working-precision CG takes over
    in the same way: only it may call the system not positive definite.
    """

    def __init__(
        self, name: str, delta: float, terms: list[Term], arithmetic: ArithmeticMode = "auto"
    ) -> None:
        self.name, self.delta, self.terms = name, delta, terms
        self.low: list[Term] = []
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
            if arithmetic == "auto":
                arithmetic = auto_arithmetic(terms)
            if arithmetic == "bfloat16" and terms[0][0].dtype != torch.bfloat16:
                self.low = [(a.bfloat16(), g.bfloat16()) for a, g in self.rotated]
                self.method += ", bfloat16 products under refinement"
        low = float(self.diagonal.min())
        if not low > 0:  # each diagonal entry is a Rayleigh quotient of K
            raise self.refusal(
                f"its diagonal in the factors' eigenbasis has an entry {low:.3e}", low
            )

    @functools.cached_property
    def _round_off(self) -> float:
        """ε·Σ‖A_k‖‖G_k‖, once per basis (bfloat16 rounds may refuse at each solve)."""
        return torch.finfo(self.terms[0][0].dtype).eps * _scale(self.terms)

    def refusal(self, detail: str, quotient: float) -> NotPositiveDefiniteError:
        """The error for a Rayleigh quotient ``quotient`` ≤ 0 of K met at δ. K needs δ above
        δ − quotient (necessary only: a quotient bounds λ_min from above, and CG's directions
        bound it loosely); PSD factors rounded to the working dtype are indefinite by about
        ε·Σ‖A_k‖‖G_k‖, which δ must also clear. The δ suggested passes both by 2×
        (``--dry-run`` finds the least that works)."""
        needed = max(self.delta - quotient, self._round_off)
        return not_pd(f"the K-FAC system of {self.name!r}", detail, delta=2 * needed)

    def solve(
        self, b: Tensor, target: float, maxiter: int, x0: Tensor | None = None
    ) -> tuple[Tensor, int]:
        """x ≈ K⁻¹ b: exact for one term; for more, CG until ‖b − Kx‖ ≤ ``target``, from
        ``x0`` where its residual is the smaller one."""
        bt = self.qg.T @ b @ self.qa
        if not self.rotated:
            return self.qg @ (bt / self.diagonal) @ self.qa.T, 0
        y0 = self.qg.T @ x0.to(b.dtype) @ self.qa if x0 is not None else None
        if self.low:
            y, its = self._mixed(bt, target, maxiter, y0)
        else:
            y, its = _pcg(self._apply, bt, self.diagonal, target, maxiter, self.refusal, y0)
        return self.qg @ y @ self.qa.T, its

    def _mixed(
        self, bt: Tensor, target: float, maxiter: int, y0: Tensor | None
    ) -> tuple[Tensor, int]:
        y = _start(self._apply, bt, self.diagonal, y0)
        r = bt - self._apply(y)
        norm, its = float(torch.linalg.norm(r)), 0
        while norm > target and its < maxiter:
            try:
                e, k = _pcg(
                    self._apply_low,
                    r,
                    self.diagonal,
                    max(target, LOW_RTOL * norm),
                    maxiter - its,
                    self.refusal,
                )
            except NotPositiveDefiniteError:
                # bfloat16's rounding of K̃p, not K, met pᵀK̃p ≤ 0 (δ small against the terms):
                # working precision decides from here, and refuses only a K that is not PD
                break
            y, its = y + e, its + k
            r = bt - self._apply(y)
            last, norm = norm, float(torch.linalg.norm(r))
            if norm > last / 2:  # bfloat16 no longer gains: working precision from here
                break
        else:  # the target met (or the budget spent) by bfloat16 rounds alone
            return y, its
        y, k = _pcg(self._apply, bt, self.diagonal, target, maxiter - its, self.refusal, y)
        return y, its + k

    def _apply(self, y: Tensor) -> Tensor:
        out = self.delta * y
        for a, g in self.rotated:
            out = out + g @ y @ a
        return out

    def _apply_low(self, y: Tensor) -> Tensor:
        out = self.delta * y
        low = y.bfloat16()
        for a, g in self.low:
            out = out + (g @ low @ a).to(y.dtype)
        return out


class LowRank:
    r"""K restricted to the joint range of its factors, solved there exactly.

    With orthonormal bases Q_A of range(Σ_k A_k) and Q_G of range(Σ_k G_k) (PSD factors: the
    joint range of the A_k is that of their sum), every term satisfies G_k X A_k =
    G_k P_G X P_A A_k (P = QQᵀ), so K = δI on the complement of range(Q_A) ⊗ range(Q_G) and

    .. math:: X = (B − Q_G \hat B Q_Aᵀ)/δ + Q_G \hat Y Q_Aᵀ,\quad
              (δI + Σ_k \hat A_k ⊗ \hat G_k)\hat Y = \hat B = Q_Gᵀ B Q_A,

    with Â_k = Q_Aᵀ A_k Q_A, Ĝ_k = Q_Gᵀ G_k Q_G: an r_G × r_A system (:class:`Basis`, in
    float64) instead of n_G × n_A. Factors estimated from M rows have rank ≤ M, so few tokens
    make this small (the Woodbury case). The ranges are found by a pivoted Cholesky of
    Σ_k A_k/‖A_k‖ (:func:`_range`), stopped where the remaining diagonal is below
    :data:`DROP` · δ / Σ_k ‖A_k‖‖G_k‖ of the largest; what that leaves of K is
    removed by :func:`solve`'s refinement against the full operator, and certified there.
    A side whose range is more than half its size is not reduced; nothing is when neither is.
    """

    def __init__(self, name: str, delta: float, terms: list[Term], qa: Tensor, qg: Tensor):
        self.delta, self.qa, self.qg = delta, qa, qg
        wide = torch.float64
        small = [(qa.T @ a.to(wide) @ qa, qg.T @ g.to(wide) @ qg) for a, g in terms]
        self.inner = Basis(name, delta, small)
        n_g, n_a = terms[0][1].shape[0], terms[0][0].shape[0]
        self.method = (
            f"low-rank reduction to {qg.shape[1]}×{qa.shape[1]} of {n_g}×{n_a}, "
            + self.inner.method
        )

    @staticmethod
    def build(name: str, delta: float, terms: list[Term]) -> LowRank | None:
        """The reduction, or ``None`` where neither side's range is at most half its size."""
        scale = _scale(terms)
        drop = DROP * delta / scale if scale > 0 else 0.0
        qa = _range([a for a, _ in terms], drop)
        qg = _range([g for _, g in terms], drop)
        if qa is None and qg is None:
            return None
        a0, g0 = terms[0]
        qa = qa if qa is not None else torch.eye(a0.shape[0], dtype=torch.float64, device=a0.device)
        qg = qg if qg is not None else torch.eye(g0.shape[0], dtype=torch.float64, device=g0.device)
        return LowRank(name, delta, terms, qa, qg)

    def solve(
        self, b: Tensor, target: float, maxiter: int, x0: Tensor | None = None
    ) -> tuple[Tensor, int]:
        """x = K'⁻¹ b, K' the operator on the kept ranges (``x0`` is not needed: direct)."""
        wide = b.to(torch.float64)
        bh = self.qg.T @ wide @ self.qa
        with _one_thread(bh.numel() <= SMALL):  # products too small to share between threads
            y, its = self.inner.solve(bh, target / 4, maxiter)
        x = (wide - self.qg @ bh @ self.qa.T) / self.delta + self.qg @ y @ self.qa.T
        return x.to(b.dtype), its


def auto_arithmetic(terms: list[Term]) -> ArithmeticMode:
    """``"bfloat16"`` for a float32 layer with both sides ≥ :data:`LOW_MIN_SIDE` on a device
    with fast bfloat16 GEMMs (:func:`fast_bfloat16`), else ``"working"``."""
    a, g = terms[0]
    big = min(a.shape[0], g.shape[0]) >= LOW_MIN_SIDE
    if a.dtype != torch.float32 or not big:
        return "working"
    return "bfloat16" if fast_bfloat16(a.device) else "working"


_FAST: dict[str, bool] = {}


def fast_bfloat16(device: torch.device) -> bool:
    """Whether bfloat16 GEMMs are measurably faster than float32 ones on ``device`` (measured
    once per process and device type): on CUDA, bfloat16 support; on a CPU, the fastest of
    three 512² products in bfloat16 at least 1.5× faster than in float32 (CPUs without native
    bfloat16 instructions emulate it, and are slower)."""
    kind = device.type
    if kind not in _FAST:
        if kind == "cuda":
            _FAST[kind] = bool(torch.cuda.is_bf16_supported())
        elif kind == "cpu":
            _FAST[kind] = _timed(torch.float32) >= 1.5 * _timed(torch.bfloat16)
        else:
            _FAST[kind] = False
    return _FAST[kind]


def _timed(dtype: torch.dtype) -> float:
    m = torch.randn(512, 512, generator=torch.Generator().manual_seed(0)).to(dtype)
    best = float("inf")
    for _ in range(4):  # the first warms up
        start = time.perf_counter()
        m @ m
        best = min(best, time.perf_counter() - start)
    return best


@contextmanager
def _one_thread(small: bool) -> Iterator[None]:
    """One intra-op thread for CG on a small reduced system, whose many tiny products would
    otherwise pay a thread barrier each (costly on a busy machine); restored afterwards."""
    threads = torch.get_num_threads()
    if small and threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _scale(terms: list[Term]) -> float:
    """Σ_k ‖A_k‖‖G_k‖ with Frobenius norms (≥ the spectral norms that bound each term)."""
    return sum(
        float(torch.linalg.matrix_norm(a.to(torch.float64)))
        * float(torch.linalg.matrix_norm(g.to(torch.float64)))
        for a, g in terms
    )


def _range(factors: list[Tensor], drop: float) -> Tensor | None:
    """An orthonormal float64 basis of the joint range of the PSD ``factors``, or ``None`` where
    that range is more than :data:`MAX_RANK` or half the side, or the side is below
    :data:`MIN_SIDE`.

    Pivoted Cholesky of S = Σ F/‖F‖_F (Higham 1990): step j takes the column of the largest
    remaining diagonal d; it stops when max d ≤ max(``drop``, :data:`NOISE`·ε) · max diag(S)
    (the left-out part
    S − LLᵀ is PSD with that largest diagonal). Cost n·r² for rank r, far below an eigh.
    """
    n = factors[0].shape[0]
    cap = min(n // 2, MAX_RANK)
    if n < MIN_SIDE:
        return None
    wide = [f.to(torch.float64) for f in factors]
    total = torch.zeros_like(wide[0])
    for f in wide:
        norm = float(torch.linalg.matrix_norm(f))
        if norm > 0:
            total += f / norm
    d = total.diagonal().clone()
    # below the factors' own rounding (an estimated rank-r factor stored in float32 has
    # eigenvalues of ~ε₃₂ beyond r) nothing is kept: refinement removes what that leaves
    noise = NOISE * torch.finfo(factors[0].dtype).eps
    floor = max(drop, noise) * float(d.max())
    columns = torch.zeros(n, cap, dtype=torch.float64, device=total.device)
    for j in range(cap + 1):
        i = int(torch.argmax(d))
        if float(d[i]) <= floor:
            return torch.linalg.qr(columns[:, :j]).Q if j else None
        if j == cap:
            return None
        col = (total[:, i] - columns[:, :j] @ columns[i, :j]) / float(d[i]) ** 0.5
        columns[:, j] = col
        d -= col * col
        d[i] = 0.0
    return None  # pragma: no cover - the loop returns


def _start(
    apply: Callable[[Tensor], Tensor], b: Tensor, diagonal: Tensor, x0: Tensor | None
) -> Tensor:
    """D⁻¹ b, or ``x0`` where its residual is the smaller (the warm start)."""
    x = b / diagonal
    if x0 is None:
        return x
    mine = float(torch.linalg.norm(b - apply(x)))
    theirs = float(torch.linalg.norm(b - apply(x0)))
    return x0 if theirs < mine else x


def _pcg(
    apply: Callable[[Tensor], Tensor],
    b: Tensor,
    diagonal: Tensor,
    target: float,
    maxiter: int,
    refuse: Callable[[str, float], NotPositiveDefiniteError],
    x0: Tensor | None = None,
) -> tuple[Tensor, int]:
    """Jacobi-preconditioned CG until the recursive residual is at most ``target`` (absolute),
    from D⁻¹b or ``x0`` (:func:`_start`); the caller certifies the true residual. Where CG
    meets pᵀKp ≤ 0 it raises ``refuse(detail, pᵀKp/pᵀp)`` (:meth:`Basis.refusal`)."""
    x = _start(apply, b, diagonal, x0)
    r = b - apply(x)
    z = r / diagonal
    p, rz = z, float((r * z).sum())
    for k in range(maxiter):
        if float(torch.linalg.norm(r)) <= target:
            return x, k
        q = apply(p)
        pq = float((p * q).sum())
        if not pq > 0:
            raise refuse(f"CG met a direction with pᵀKp = {pq:.3e}", pq / float((p * p).sum()))
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
