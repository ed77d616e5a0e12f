"""``OutputHessian`` (Λ = S Sᵀ, the loss Hessian in the outputs) against torch.func.hessian.

The reference differentiates the per-position loss twice with autograd (its own loss code),
block by block; S, its columns and Λ u must reproduce it, with ignored positions giving 0.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import hessian

from gradmerge.estimate._data import Loss
from gradmerge.estimate._output_hessian import OutputHessian

F64 = torch.float64
IGNORE = -100


def reference_blocks(f: torch.Tensor, targets: torch.Tensor, loss: str) -> torch.Tensor:
    """∇²_f ℓ(f_s, y_s) per position s, shape (*positions, C, C), by autograd."""
    c = f.shape[-1]
    flat_f, flat_y = f.reshape(-1, c), targets.reshape(-1, *targets.shape[f.ndim - 1 :])
    blocks = []
    for fs, ys in zip(flat_f, flat_y, strict=True):
        if loss == "mse":
            value = lambda z, y=ys: 0.5 * ((z - y) ** 2).sum()  # noqa: E731
        else:
            value = lambda z, y=ys: nn.functional.cross_entropy(  # noqa: E731
                z[None], y[None], ignore_index=IGNORE, reduction="sum"
            )
        blocks.append(hessian(value)(fs))
    return torch.stack(blocks).reshape(*f.shape, c)


def cases():
    g = torch.Generator().manual_seed(0)
    f = torch.randn(3, 4, 5, generator=g, dtype=F64)  # (B, positions, classes)
    y = torch.randint(0, 5, (3, 4), generator=g)
    y[0, 1] = y[2, 3] = IGNORE
    yield "cross_entropy", f, y
    yield "cross_entropy", f[:, 0], y[:, 0]  # no positions
    yield "mse", f, torch.randn(3, 4, 5, generator=g, dtype=F64)


@pytest.mark.parametrize("case", list(range(3)))
def test_factor_columns_and_mv_reproduce_the_autograd_hessian(case):
    loss, f, y = list(cases())[case]
    lam = OutputHessian(f, y, Loss(loss))
    want = reference_blocks(f, y, loss)
    s = lam.matrix()
    torch.testing.assert_close(s @ s.mT, want, rtol=1e-12, atol=1e-14)
    for c in range(lam.classes):  # column(c) is column c of S, at every position
        torch.testing.assert_close(lam.column(c), s[..., :, c], rtol=0, atol=1e-15)
    u = torch.randn(f.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    torch.testing.assert_close(lam.mv(u), (want @ u[..., None])[..., 0], rtol=1e-12, atol=1e-14)
    if loss == "cross_entropy":  # an ignored position has Λ = 0, hence S = 0
        ignored = y == IGNORE
        assert bool(ignored.any()) == (f.ndim == 3)
        assert bool((s[ignored] == 0).all())


def test_scalar_mse_outputs_have_one_unit_column():
    f = torch.randn(4, dtype=F64)
    lam = OutputHessian(f, torch.zeros(4, dtype=F64), Loss("mse"))
    assert lam.classes == 1
    torch.testing.assert_close(lam.column(0), torch.ones(4, dtype=F64))
    torch.testing.assert_close(lam.matrix(), torch.eye(1, dtype=F64))


def test_half_precision_outputs_are_factored_in_float32_and_returned_in_their_dtype():
    f = torch.randn(6, 7, dtype=F64)
    y = torch.randint(0, 7, (6,))
    exact = OutputHessian(f, y, Loss("cross_entropy")).matrix()
    half = OutputHessian(f.bfloat16(), y, Loss("cross_entropy"))
    assert half.p is not None and half.p.dtype == torch.float32
    s = half.matrix()
    assert s.dtype == torch.bfloat16
    # bf16 inputs (8 bits of mantissa): the factor is that of the rounded logits, to bf16 accuracy
    rounded = OutputHessian(f.bfloat16().double(), y, Loss("cross_entropy")).matrix()
    torch.testing.assert_close(s.double(), rounded, rtol=0, atol=2**-8)
    assert float((rounded - exact).abs().max()) < 0.05
