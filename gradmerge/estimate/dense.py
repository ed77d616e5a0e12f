"""Dense curvature of small models: exact Hessian, GGN, empirical or Monte-Carlo Fisher.

Every matrix is a SUM over examples (see :mod:`gradmerge.estimate._data`), over the flattened
trainable parameters in ``model.named_parameters()`` order — the layout of :class:`gm.Dense`:

- ``"hessian"``: Σ_i ∇²ℓ_i(θ) (torch.func.hessian of the batch's summed loss);
- ``"ggn"``: Σ_i J_iᵀ Λ_i J_i, Λ_i the Hessian of the loss in the outputs (diag(p) − ppᵀ for
  cross-entropy, I for MSE), J_i the Jacobian of example i's outputs;
- ``"empirical"``: Σ_i ∇ℓ_i(θ; y_i) ∇ℓ_i(θ; y_i)ᵀ with the observed targets;
- ``"mc"``: Σ_i (1/k) Σ_j ∇ℓ_i(θ; ŷ_ij) ∇ℓ_i(θ; ŷ_ij)ᵀ, ŷ_ij drawn from the model (seeded).

Intended for models up to ``max_params`` parameters (default: :class:`~gradmerge.estimate.options.
EstimateOptions`' declaration; the matrix takes ``max_params² × 4`` bytes in float32).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.func import hessian, jacrev

from gradmerge.curvature import Dense
from gradmerge.estimate._data import Loss, batches, per_example_loss, sample_targets
from gradmerge.estimate._functional import FlatModel, check_size, trainable
from gradmerge.estimate._output_hessian import OutputHessian
from gradmerge.estimate.options import (
    EstimateOptions,
    Fisher,
    LossFunction,
    LossName,
    check_fisher,
    check_mc_samples,
    check_params,
)
from gradmerge.params import unflatten

DenseKind = Literal["hessian", "ggn", "empirical", "mc"]


def estimate_dense(
    model: nn.Module,
    data: Iterable[Any],
    *,
    fisher: Fisher | DenseKind = Fisher.GGN.value,
    loss: LossFunction | LossName = EstimateOptions.loss,
    mc_samples: int = EstimateOptions.mc_samples,
    seed: int = EstimateOptions.seed,
    ignore_index: int = EstimateOptions.ignore_index,
    params: Sequence[str] | None = None,
    max_params: int = EstimateOptions.max_params,
) -> Dense:
    """The dense curvature (a SUM over examples) of a small model on ``data``.

    Example:
        >>> import torch, gradmerge as gm
        >>> from gradmerge.estimate.dense import estimate_dense
        >>> model = torch.nn.Linear(2, 1, bias=False).double()
        >>> X = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> H = estimate_dense(model, [(X, torch.zeros(2, 1, dtype=torch.float64))], fisher="ggn", loss="mse")
        >>> H.matrix                                     # XᵀX for ½‖Xθ − y‖²
        tensor([[1., 0.],
                [0., 4.]], dtype=torch.float64)
    """
    fisher = check_fisher(fisher, list(Fisher))
    check_mc_samples(mc_samples)
    spec = Loss(loss, ignore_index)
    chosen = trainable(model, check_params(params))
    flat = FlatModel(model, chosen, spec)
    check_size(flat.numel, max_params, "a dense curvature")
    generator = torch.Generator().manual_seed(seed)
    theta = (
        flat.theta.float() if flat.theta.dtype in (torch.float16, torch.bfloat16) else flat.theta
    )
    total = torch.zeros(flat.numel, flat.numel, dtype=theta.dtype, device=theta.device)
    for index, inputs, targets in batches(data, device=theta.device):
        if fisher == "hessian":
            total += _hessian(flat, theta, inputs, targets, index)
        elif fisher == "ggn":
            total += _ggn(flat, theta, inputs, targets, spec, index)
        else:
            draws = 1 if fisher == "empirical" else mc_samples
            for _ in range(draws):
                y = targets
                if fisher == "mc":
                    y = sample_targets(flat.outputs(theta, inputs), targets, spec, generator)
                g = _per_example_grads(flat, theta, inputs, y, index)
                total += g.T @ g / draws
    return Dense(0.5 * (total + total.T), unflatten(theta, flat.layout))


def _hessian(flat: FlatModel, theta: Tensor, inputs: Any, targets: Tensor, index: int) -> Tensor:
    """Σ_i ∇²ℓ_i for one batch."""
    return hessian(lambda th: flat.losses(th, inputs, targets, index).sum())(theta)


def _ggn(
    flat: FlatModel, theta: Tensor, inputs: Any, targets: Tensor, spec: Loss, index: int
) -> Tensor:
    """Σ_positions Jᵀ S Sᵀ J for one batch."""
    jac = jacrev(lambda th: flat.outputs(th, inputs))(theta)  # (*out, n)
    out = flat.outputs(theta, inputs).detach()
    per_example_loss(out, targets, spec, batch=index)  # checks the targets and finiteness
    if spec.name == "mse" and out.ndim == 1:
        return jac.T @ jac
    s = OutputHessian(out, targets, spec).matrix()  # S: (*positions, C, C), Λ = S Sᵀ
    jac = jac.reshape(-1, out.shape[-1], theta.numel())  # (positions, C, n)
    s = s.reshape(-1, out.shape[-1], out.shape[-1])
    sj = torch.einsum("pcd,pcn->pdn", s, jac).reshape(-1, theta.numel())  # rows Sᵀ J
    return sj.T @ sj


def _per_example_grads(
    flat: FlatModel, theta: Tensor, inputs: Any, targets: Tensor, index: int
) -> Tensor:
    """(B, n): row i is ∇ℓ_i, the Jacobian of the vector of per-example losses."""
    return jacrev(lambda th: flat.losses(th, inputs, targets, index))(theta)
