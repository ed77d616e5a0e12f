r"""The loss gradient of a model on data, as a function of the parameters: θ ↦ ∇ℓ̄(θ).

ℓ̄(θ) = Σ_i ℓ_i(θ) is the SUM of the per-example losses over ``data`` (the convention of every
curvature estimate, :mod:`gradmerge.estimate._data`: a sequence's loss sums its tokens,
``ignore_index`` positions count for nothing). :func:`gradient_fn` returns the function Eq. 2's
mismatch (``gm.gradient_mismatch``) and iterative refinement (``gm.refine``) take for each task:
it evaluates the model at any parameter dict θ by ``torch.func.functional_call``, so the model's
own weights are left alone.

Example:
    >>> import torch, gradmerge as gm
    >>> model = torch.nn.Linear(3, 2)
    >>> data = [(torch.randn(4, 3), torch.tensor([0, 1, 1, 0]))]
    >>> grad = gm.gradient_fn(model, data)
    >>> theta = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    >>> g = grad(theta)   # at θ = 0 every logit is 0: ∇_b = Σ_i (softmax − onehot) = 0
    >>> sorted(g), torch.allclose(g["bias"], torch.zeros(2))
    (['bias', 'weight'], True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradmerge import params as P
from gradmerge.estimate._data import Loss, batches, forward, per_example_loss
from gradmerge.estimate._functional import _Bound, trainable
from gradmerge.estimate.options import EstimateOptions, LossFunction, LossName
from gradmerge.params import Params


def gradient_fn(
    model: nn.Module,
    data: Iterable[Any],
    *,
    loss: LossFunction | LossName = EstimateOptions.loss,
    ignore_index: int = EstimateOptions.ignore_index,
    params: Sequence[str] | None = None,
) -> Callable[[Params], dict[str, Tensor]]:
    r"""θ ↦ ∇ℓ̄(θ) = Σ_i ∇ℓ_i(θ) of ``model`` over ``data`` (a SUM over examples).

    Args:
        model: the architecture (its own parameter values are not used; put it in ``eval()``
            mode for a gradient without dropout).
        data: re-iterable batches ``(inputs, targets)`` or dicts with ``"labels"``.
        loss: ``"cross_entropy"`` or ``"mse"`` (ℓ_i = ½‖f_i − y_i‖²).
        ignore_index: target value of positions that count for nothing (cross-entropy).
        params: the parameter names θ covers (default: every trainable parameter); the others
            keep the model's values.

    Returns:
        A function of a parameter dict with exactly those names, returning the gradient dict
        (same names, shapes and dtypes).

    Raises:
        StructureError: a θ with other names or shapes (the key is named); batches that do not fit
            the loss.
        NonFiniteError: a NaN/Inf loss.
    """
    spec = Loss(loss, ignore_index)
    reference = {k: v.detach() for k, v in trainable(model, params).items()}
    device = next(iter(reference.values())).device

    def gradient(theta: Params) -> dict[str, Tensor]:
        P.check_params(theta, name="theta")
        P.check_compatible(reference, theta, ref_name="the model's parameters", name="theta")
        leaves = {k: v.detach().requires_grad_(True) for k, v in theta.items()}
        total: dict[str, Tensor] = {k: torch.zeros_like(v) for k, v in leaves.items()}
        for index, inputs, targets in batches(data, device=device):
            bound = _Bound(model, leaves)
            outputs = forward(bound, inputs)
            value = per_example_loss(outputs, targets, spec, batch=index).sum()
            grads = torch.autograd.grad(value, list(leaves.values()), allow_unused=True)
            for acc, g in zip(total.values(), grads, strict=True):
                if g is not None:
                    acc.add_(g)
        return total

    return gradient
