"""A model as a function of one flat parameter vector (for dense and matrix-free curvature)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn
from torch.func import functional_call

from gradmerge import params as P
from gradmerge.errors import ArgumentError, StructureError
from gradmerge.estimate._data import Inputs, Loss, forward, per_example_loss


def trainable(model: nn.Module, names: Sequence[str] | None = None) -> dict[str, Tensor]:
    """The parameters curvature is estimated for: all trainable ones, or the named subset."""
    all_params: dict[str, Tensor] = dict(model.named_parameters())
    if names is None:
        chosen = {k: v for k, v in all_params.items() if v.requires_grad}
    else:
        missing = [n for n in names if n not in all_params]
        if missing:
            raise StructureError(
                f"params names {missing} that the model does not have; it has "
                f"{list(all_params)[:5]}{' ...' if len(all_params) > 5 else ''}"
            )
        chosen = {n: all_params[n] for n in names}
    if not chosen:
        raise StructureError("the model has no trainable parameters to estimate curvature for")
    return chosen


class FlatModel:
    """θ ↦ outputs and θ ↦ per-example losses, θ the flattened ``params`` (in their key order)."""

    def __init__(self, model: nn.Module, params: dict[str, Tensor], loss: Loss) -> None:
        self.model, self.loss = model, loss
        self.layout = P.layout_of(params)
        self.theta = P.flatten({k: v.detach() for k, v in params.items()})
        self.numel = self.theta.numel()

    def outputs(self, theta: Tensor, inputs: Inputs) -> Tensor:
        return forward(_Bound(self.model, P.unflatten(theta, self.layout)), inputs)

    def losses(self, theta: Tensor, inputs: Inputs, targets: Tensor, batch: int) -> Tensor:
        return per_example_loss(self.outputs(theta, inputs), targets, self.loss, batch=batch)


class _Bound(nn.Module):
    """``model`` with some parameters replaced (torch.func.functional_call), callable as usual."""

    def __init__(self, model: nn.Module, params: dict[str, Tensor]) -> None:
        super().__init__()
        self._model, self._params = model, params

    def forward(self, *args: object, **kwargs: object) -> object:
        return functional_call(self._model, self._params, args, kwargs)


def check_size(numel: int, limit: int, what: str) -> None:
    if numel > limit:
        raise ArgumentError(
            f"{what} over {numel} parameters needs a {numel}×{numel} matrix; the limit is "
            f"{limit} (max_params). Use structure='kfac' or 'diag', or the matrix-free operator "
            "gm.MatrixFree for large models."
        )
