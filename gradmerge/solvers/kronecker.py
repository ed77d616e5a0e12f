"""Exact solves of one or two Kronecker products per layer, and the eigendecompositions they use.

A layer's operator acts on the matrix X = [V | b] (out × in[+1]) as X ↦ Σ_k G_k X A_k
(:class:`gradmerge.KFAC`). Symmetric factors are diagonalised once per process: :func:`eigh`
keeps each factor's eigendecomposition for as long as the factor lives (and derives that of a
scaled copy, c·G, from G's), so a PSD check, a solve and the next merge of the same curvature
share one decomposition.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from gradmerge.errors import ArgumentError, not_pd

Term = tuple[Tensor, Tensor]
Factorisation = tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor]]

# id(factor) → (weak reference to it, its version counter, eigenvalues, eigenvectors)
_EIGEN: dict[int, tuple[weakref.ref[Tensor], int, Tensor, Tensor]] = {}


def eigh(m: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues (ascending) and eigenvectors of the symmetric part of ``m``, computed once
    per factor (kept until ``m`` is freed or modified in place).

    Computed on ``m`` scaled to unit size (LAPACK can fail to converge on matrices of subnormal
    numbers, e.g. δ·I with a tiny δ); c·I is read off without a decomposition.

    Example:
        >>> import torch
        >>> lam, q = eigh(torch.tensor([[2.0, 1.0], [1.0, 2.0]]))
        >>> lam
        tensor([1., 3.])
    """
    hit = _EIGEN.get(id(m))
    if hit is not None and hit[0]() is m and hit[1] == m._version:
        return hit[2], hit[3]
    c = identity_multiple(m)
    if c is not None:
        lam, q = torch.full_like(m[0], c), torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
    else:
        sym = (m + m.T) / 2
        scale = sym.abs().max()
        if bool(scale > 0):
            lam, q = torch.linalg.eigh(sym / scale)
            lam = lam * scale
        else:
            lam, q = torch.linalg.eigh(sym)
    _remember(m, lam, q)
    return lam, q


def eigenvalues(m: Tensor) -> Tensor:
    """Eigenvalues of the symmetric factor ``m``, ascending: those of a known decomposition
    (:func:`eigh`), c for c·I, else from ``eigvalsh`` (no eigenvectors, not kept)."""
    hit = _EIGEN.get(id(m))
    if hit is not None and hit[0]() is m and hit[1] == m._version:
        return hit[2]
    c = identity_multiple(m)
    return torch.full_like(m[0], c) if c is not None else torch.linalg.eigvalsh((m + m.T) / 2)


def derive_scaled(scaled: Tensor, original: Tensor, c: float) -> None:
    """Record that ``scaled`` = c·``original``: its eigendecomposition, if ``original``'s is
    known, is (c·λ, Q) (reordered ascending), with no new decomposition."""
    hit = _EIGEN.get(id(original))
    if hit is None or hit[0]() is not original or hit[1] != original._version:
        return
    lam, q = hit[2] * c, hit[3]
    if c < 0:
        lam, q = lam.flip(0), q.flip(1)
    _remember(scaled, lam, q)


def _remember(m: Tensor, lam: Tensor, q: Tensor) -> None:
    key = id(m)
    _EIGEN[key] = (weakref.ref(m, _forget(key)), m._version, lam, q)


def _forget(key: int) -> Callable[[weakref.ref[Tensor]], None]:
    def callback(ref: weakref.ref[Tensor]) -> None:
        entry = _EIGEN.get(key)
        if entry is not None and entry[0] is ref:
            del _EIGEN[key]

    return callback


def identity_multiple(g: Tensor) -> float | None:
    """c if G = c·I exactly, else None (an estimated factor is rejected by two entries; no
    identity is formed)."""
    n, c = g.shape[0], float(g[0, 0])
    if n > 1 and (float(g[0, 1]) != 0 or float(g[1, 1]) != c):
        return None
    if not bool((g.diagonal() == c).all()):
        return None
    return c if int(torch.count_nonzero(g)) == (n if c != 0 else 0) else None


def eye_like(m: Tensor) -> Tensor:
    """The identity of ``m``'s side, dtype and device."""
    return torch.eye(m.shape[0], dtype=m.dtype, device=m.device)


def conditioning(term: Term) -> float:
    """λ_min/λ_max of A ⊗ G (≤ 0 when a factor is singular or indefinite)."""
    ea, eg = (eigh(m)[0] for m in term)
    top = float(ea.abs().max() * eg.abs().max())
    return float(ea[0] * eg[0]) / top if ea[0] > 0 and eg[0] > 0 and top > 0 else -1.0


def factorise(name: str, terms: list[Term]) -> Factorisation:
    """Diagonalise A₁ ⊗ G₁ (+ A₂ ⊗ G₂) as (T_A Q_A ⊗ T_G Q_G)⁻ᵀ diag(denom) (...)⁻¹.

    One term: T = I, Q the eigenvectors, denom = λ_G λ_Aᵀ. Two terms: with A₁ = L_A L_Aᵀ (L from
    the eigendecomposition, pseudo-inverse-free: A₁ must be PD), T_A = L_A⁻ᵀ, and Q_A the
    eigenvectors of T_Aᵀ A₂ T_A (likewise G): denom = 1 + μ_G μ_Aᵀ. The solve
    (:func:`apply_inverse`) is x = T_G Q_G [(Q_Gᵀ T_Gᵀ b T_A Q_A) / denom] Q_Aᵀ T_Aᵀ.

    A system is numerically singular when its smallest eigenvalue is below max(n_A, n_G, 10)·ε
    times its largest (the size of round-off in eigenvalues of an n × n matrix).

    Raises:
        NotPositiveDefiniteError: the sum is singular, or (two terms) the better-conditioned
            term's factors are not positive definite.
    """
    if len(terms) == 1:
        (a, g) = terms[0]
        la, qa = eigh(a)
        lg, qg = eigh(g)
        denom = torch.outer(lg, la)
        trans = (eye_like(a), eye_like(g))
    elif len(terms) == 2:
        # the better-conditioned term defines the metric (it must be positive definite), unless
        # it is negligible next to the other (a tiny δ·I): its inverse would overflow
        ordered = sorted(terms, key=conditioning, reverse=True)
        size_of = [float(a.abs().max()) * float(g.abs().max()) for a, g in ordered]
        tiny = size_of[0] < torch.finfo(ordered[0][0].dtype).eps * size_of[1]
        if tiny and conditioning(ordered[1]) > 0:
            ordered.reverse()
        (a1, g1), (a2, g2) = ordered
        # factors scaled to unit size (s_A, s_G): T_Aᵀ A₁ T_A = s_A I, so denom carries s_A s_G
        sa, sg = a1.abs().max(), g1.abs().max()
        ta, tg = _inv_sqrt(name, a1 / sa), _inv_sqrt(name, g1 / sg)
        ma, qa = eigh(ta.T @ (a2 / sa) @ ta)
        mg, qg = eigh(tg.T @ (g2 / sg) @ tg)
        denom = (sa * sg) * (1.0 + torch.outer(mg, ma))
        trans = (ta, tg)
    else:  # pragma: no cover - callers dispatch
        raise ArgumentError("direct K-FAC solves take one or two terms")
    scale = float(denom.abs().max())
    size = max(denom.shape[0], denom.shape[1], 10)
    floor = size * torch.finfo(denom.dtype).eps * max(scale, 1e-300)
    if float(denom.min()) <= floor:
        raise not_pd(
            f"K-FAC system of {name!r}",
            f"smallest eigenvalue {float(denom.min()):.3e}, not above the round-off floor "
            f"{floor:.3e} of a system whose largest is {scale:.3e}",
            delta=10 * floor,
        )
    return qa, qg, denom, trans


def apply_inverse(parts: Factorisation, b: Tensor) -> Tensor:
    """x = K⁻¹ b for a :func:`factorise` d operator K, b an (out × in[+1]) matrix."""
    qa, qg, denom, (ta, tg) = parts
    y = qg.T @ tg.T @ b @ ta @ qa
    return tg @ qg @ (y / denom) @ qa.T @ ta.T


def _inv_sqrt(name: str, m: Tensor) -> Tensor:
    """T with Tᵀ M T = I, from the eigendecomposition of the SPD matrix M."""
    lam, q = eigh(m)
    if float(lam.min()) <= 0:
        raise not_pd(
            f"K-FAC factor of {name!r}",
            f"smallest eigenvalue {float(lam.min()):.3e}; a two-term solve needs the first "
            "term's factors positive definite (damping δ makes the I ⊗ δI term a good first term)",
        )
    return q / lam.sqrt()
