"""Independent references for the unit tests: random SPD matrices, layouts, and the merge rules
written directly with dense numpy matrices (no gradmerge code involved)."""

from __future__ import annotations

import numpy as np
import torch

import gradmerge as gm


def random_layout(rng: np.random.Generator, max_tensors: int = 3, max_dim: int = 3) -> dict:
    """A parameter dict of 1–3 tensors of random shapes (0-dim tensors included)."""
    out = {}
    for i in range(int(rng.integers(1, max_tensors + 1))):
        ndim = int(rng.integers(0, 3))
        shape = tuple(int(rng.integers(1, max_dim + 1)) for _ in range(ndim))
        out[f"layer{i}.w"] = torch.as_tensor(rng.standard_normal(shape), dtype=torch.float64)
    return out


def random_spd(rng: np.random.Generator, n: int, condition: float = 10.0) -> np.ndarray:
    """A symmetric positive definite n×n matrix with eigenvalues log-spaced in [1, condition]."""
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    eig = np.logspace(0, np.log10(condition), n)
    rng.shuffle(eig)
    m = (q * eig) @ q.T
    return (m + m.T) / 2


def spd_tensor(
    rng: np.random.Generator,
    n: int,
    condition: float = 10.0,
    *,
    rank: int | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """:func:`random_spd` as a tensor; with ``rank``, the PSD matrix keeping its ``rank`` largest
    eigenvalues (the others set to 0)."""
    m = random_spd(rng, n, condition)
    if rank is not None:
        w, q = np.linalg.eigh(m)
        w[: n - rank] = 0.0
        m = (q * w) @ q.T
    return torch.as_tensor((m + m.T) / 2, dtype=dtype)


def like_params(params: dict, vector: np.ndarray) -> dict:
    return gm.params.unflatten(
        torch.as_tensor(vector, dtype=torch.float64), gm.params.layout_of(params)
    )


def flat(params: dict) -> np.ndarray:
    return gm.params.flatten(params).double().numpy()


def merge_dense(base: np.ndarray, fts: list, hs: list, h0: np.ndarray, alphas: list) -> np.ndarray:
    """Eq. 6 with dense matrices, solved with numpy."""
    hbar = h0 + sum(a * h for a, h in zip(alphas, hs, strict=True))
    rhs = sum(a * (h0 + h) @ (ft - base) for a, h, ft in zip(alphas, hs, fts, strict=True))
    return base + np.linalg.solve(hbar, rhs)


def remove_dense(base, ft, ht, h0, remaining, alpha) -> np.ndarray:
    """Eq. 13 with dense matrices, solved with numpy."""
    return base - alpha * np.linalg.solve(remaining, (h0 + ht) @ (ft - base))


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))
