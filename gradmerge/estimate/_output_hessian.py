r"""The Hessian Λ of the loss in the model's outputs, and its square root S (Λ = S Sᵀ).

The generalised Gauss-Newton of a SUM of per-example losses is ``Σ_i J_iᵀ Λ_i J_i`` with ``J_i``
the Jacobian of example ``i``'s outputs and ``Λ_i = ∇²_f ℓ(f_i, y_i)``. Every estimator that
needs Λ (dense GGN, diagonal GGN, K-FAC type-2, matrix-free GGN-vector products) takes it from
:class:`OutputHessian`, per position ``s`` (Λ is block-diagonal over positions: each position's
loss depends on its own logits only):

- cross-entropy, ``p = softmax(f_s)``: ``Λ_s = diag(p) − p pᵀ``, factored as ``Λ_s = S_s S_sᵀ``
  with ``S_s = diag(√p) − p √pᵀ`` (column ``c`` is ``√p_c (e_c − p)``; check:
  ``S Sᵀ = diag(p) − 2 p pᵀ + p (Σ_c p_c) pᵀ = diag(p) − p pᵀ`` since ``Σ_c p_c = 1``);
  ``Λ_s = 0`` (and ``S_s = 0``) at positions whose target is ``ignore_index``.
- mse (``ℓ = ½‖f − y‖²``): ``Λ_s = S_s = I``.

``S`` is never formed for more than one column at a time by the estimators (``column``): for a
50k-token vocabulary a dense ``S_s`` per position would not fit. ``matrix()`` forms it densely
for small outputs (the dense GGN).

Computation happens in the accumulation dtype (float32 for 16-bit outputs); results are
returned in the outputs' dtype.

Example:
    >>> import torch
    >>> from gradmerge.estimate._data import Loss
    >>> from gradmerge.estimate._output_hessian import OutputHessian
    >>> f = torch.tensor([[0.0, 0.0]], dtype=torch.float64)       # p = (½, ½)
    >>> lam = OutputHessian(f, torch.tensor([0]), Loss("cross_entropy"))
    >>> s = lam.matrix()[0]
    >>> s @ s.T                                                    # diag(p) − ppᵀ
    tensor([[ 0.2500, -0.2500],
            [-0.2500,  0.2500]], dtype=torch.float64)
    >>> lam.mv(torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    tensor([[ 0.2500, -0.2500]], dtype=torch.float64)
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradmerge.estimate._data import Loss, accumulation_dtype


class OutputHessian:
    """Λ = S Sᵀ of ``loss`` at the outputs ``f`` (shape ``(..., C)``; ``(B,)`` for scalar mse).

    Attributes:
        classes: C, the number of columns of S per position (1 for scalar mse outputs).
    """

    def __init__(self, outputs: Tensor, targets: Tensor, loss: Loss) -> None:
        self.outputs, self.loss = outputs.detach(), loss
        self.scalar = loss.name == "mse" and outputs.ndim == 1
        self.classes = 1 if self.scalar else int(outputs.shape[-1])
        self.p: Tensor | None = None
        self.keep: Tensor | None = None
        if loss.name == "cross_entropy":
            work = self.outputs.to(accumulation_dtype(self.outputs))
            self.p = torch.softmax(work, dim=-1)
            self.keep = (targets != loss.ignore_index).unsqueeze(-1).to(self.p.dtype)

    def column(self, c: int) -> Tensor:
        """``S[..., :, c]`` at every position, shape of the outputs: ``√p_c (e_c − p)`` masked
        (cross-entropy) or ``e_c`` (mse)."""
        f = self.outputs
        if self.p is None:
            column = torch.zeros_like(f)
            if self.scalar:
                return column.fill_(1.0)
            column[..., c] = 1.0
            return column
        assert self.keep is not None
        root = self.p[..., c : c + 1].sqrt() * self.keep  # √p_c, 0 at ignored positions
        column = -root * self.p
        column[..., c] += root[..., 0]
        return column.to(f.dtype)

    def matrix(self) -> Tensor:
        """S densely, shape ``(..., C, C)`` (``(C, C)`` = I for scalar mse): column c is
        ``column(c)``. For small outputs only (``positions · C²`` entries)."""
        f = self.outputs
        if self.p is None:
            eye = torch.eye(self.classes, dtype=f.dtype, device=f.device)
            return eye if self.scalar else eye.expand(*f.shape[:-1], self.classes, self.classes)
        assert self.keep is not None
        sqrt_p = self.p.sqrt()
        factor = torch.diag_embed(sqrt_p) - self.p[..., :, None] * sqrt_p[..., None, :]
        return (factor * self.keep[..., None]).to(f.dtype)

    def mv(self, u: Tensor) -> Tensor:
        """Λ u per position (u of the outputs' shape): ``p∘u − p (pᵀu)`` masked, or ``u``."""
        if self.p is None:
            return u
        assert self.keep is not None
        p = self.p.to(u.dtype)
        lam_u = p * u - p * (p * u).sum(dim=-1, keepdim=True)
        return lam_u * self.keep.to(u.dtype)
