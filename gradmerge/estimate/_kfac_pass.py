"""K-FAC's passes over one batch: the forward hooks that add to A, the backward passes for G.

:class:`Recorder` hooks the covered layers (:mod:`gradmerge.estimate._kfac_layers`): during the
forward pass it adds each call's inputs to A and notes where its output sits in the graph; then
:func:`backward_passes` asks autograd for those outputs' gradients only (no weight gradients),
from the loss (``"empirical"``), sampled targets (``"mc"``) or the output Hessian's columns
(``"ggn"``), several vectors per vmapped pass (:mod:`gradmerge.estimate._batched`), and adds
them to G.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from gradmerge.errors import ArgumentError, StructureError
from gradmerge.estimate._batched import Backward, group_size, groups
from gradmerge.estimate._data import Loss, loss_gradient, sample_targets
from gradmerge.estimate._kfac_layers import Layer, Masks, add_grads, add_inputs, layer_inputs
from gradmerge.estimate._output_hessian import OutputHessian
from gradmerge.estimate.diagonal import SharedPassDiagonal
from gradmerge.estimate.options import KFACApprox


@dataclass(frozen=True)
class Tap:
    """One call of a covered module whose output gradient is wanted."""

    layer: Layer
    edge: GradientEdge  # the output's place in the graph (``get_gradient_edge``)
    keep: Tensor | None
    approx: KFACApprox
    numel: int  # of the output


class Recorder:
    """Forward hooks on the covered modules: add to A and note the outputs, during one batch.

    The output gradients are then asked of autograd directly (``collect``), not the weight
    gradients: the backward pass skips the weight (and bias) gradients that K-FAC never uses.
    """

    def __init__(self, layers: dict[str, Layer], approx: KFACApprox) -> None:
        self.layers = layers
        self.approx = approx
        self.masks: Masks | None = None
        self.batch_size = 0
        self.taps: list[Tap] = []
        self.skipped: dict[str, str] = {}
        self.called: set[str] = set()

    def left_out(self) -> dict[str, str]:
        """Covered modules whose factors cannot be trusted, with the reason."""
        never = "never called by the forward pass (is its weight used functionally, as in "
        never += "nn.MultiheadAttention.out_proj?)"
        unseen = {name: never for name in self.layers if name not in self.called}
        return {**unseen, **self.skipped}

    def start_batch(self, masks: Masks, batch_size: int) -> None:
        self.masks, self.batch_size, self.taps = masks, batch_size, []
        for layer in self.layers.values():
            layer.calls = 0

    def hook(self, name: str, module: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
        layer = self.layers[name]
        if self.masks is None or name in self.skipped or not isinstance(out, Tensor):
            return
        x = args[0]
        if x.shape[0] != self.batch_size:
            self.skipped[name] = (
                f"called with batch dimension {x.shape[0]}, not the batch's {self.batch_size}"
            )
            return
        layer.calls += 1
        self.called.add(name)
        approx = KFACApprox.EXPAND if layer.kind == "embedding" else self.approx
        if approx == "reduce" and layer.calls > 1:
            raise StructureError(
                f"module {name!r} is called more than once per forward pass; "
                "use kfac_approx='expand' for weight sharing across calls"
            )
        positions, a = layer_inputs(layer, x.detach(), out)
        keep = self.masks.keep(positions, a.device)
        add_inputs(layer, a, keep, approx)
        if out.requires_grad:
            # The edge rather than the tensor: an in-place op on the output later on (e.g.
            # nn.ReLU(inplace=True)) rebases the tensor onto that op, the edge stays put.
            self.taps.append(Tap(layer, get_gradient_edge(out), keep, approx, out.numel()))

    def collect(
        self,
        root: Tensor,
        wrt: list[Tensor],
        weight: float = 1.0,
        rider: SharedPassDiagonal | None = None,
        **kwargs: Any,
    ) -> None:
        """One backward pass from ``root``: add ``weight`` · Σ g gᵀ of the noted outputs to G,
        and hand the gradients of the ``rider``'s outputs from the same pass to it (as one
        vector's; a rider that needs the vector itself, :attr:`SharedPassDiagonal.needs_vectors`,
        goes through :meth:`collect_vectors`)."""
        riding = [] if rider is None else rider.outputs
        if not self.taps and not riding:  # the pass still runs, for autograd's own errors
            torch.autograd.grad(root, wrt, allow_unused=True, **kwargs)
            if rider is not None:
                rider.add([], [])
            return
        edges = [tap.edge for tap in self.taps] + [get_gradient_edge(t) for t in riding]
        grads = torch.autograd.grad(root, edges, allow_unused=True, **kwargs)
        for tap, g in zip(self.taps, grads, strict=False):
            if g is not None:  # None: the output does not reach the loss
                add_grads(tap.layer, g, tap.keep, tap.approx, weight)
        if rider is not None:
            rider.add([], [None if g is None else g.unsqueeze(0) for g in grads[len(self.taps) :]])

    def collect_vectors(
        self,
        outputs: Tensor,
        vectors: Iterable[Tensor],
        wrt: list[Tensor],
        weight: float,
        backward: Backward,
        rider: SharedPassDiagonal | None = None,
    ) -> None:
        """Backward passes of ``Σ_i v_irᵀ f_i`` for the output vectors ``v_r``, several per pass
        (``_batched``): add ``weight`` · Σ_r Σ g_r g_rᵀ of the noted outputs to G, and hand the
        gradients of the ``rider``'s outputs from the same passes to it.

        The ``R`` gradients of one pass, ``(R, B, ...)``, are ``R · B`` rows of one Gram product
        per layer (``reduce`` sums positions per vector and example, as one pass at a time would).
        """
        riding = [] if rider is None else rider.outputs
        per_vector = outputs.numel() + sum(tap.numel for tap in self.taps)
        per_vector += sum(t.numel() for t in riding)
        for group in groups(vectors, group_size(per_vector)):
            if not self.taps and not riding:  # the pass still runs, for autograd's errors
                for v in group:
                    root = (outputs * v).sum()
                    torch.autograd.grad(root, wrt, allow_unused=True, retain_graph=True)
                if rider is not None:
                    rider.add(group, [])
                continue
            edges = [tap.edge for tap in self.taps] + [get_gradient_edge(t) for t in riding]
            grads = backward.grads(outputs, edges, group)
            for tap, g in zip(self.taps, grads, strict=False):
                if g is None:  # the output does not reach the loss
                    continue
                keep = None if tap.keep is None else tap.keep.repeat(len(group), 1)
                add_grads(tap.layer, g.flatten(0, 1), keep, tap.approx, weight)
            if rider is not None:
                rider.add(group, grads[len(self.taps) :])


def backward_passes(
    outputs: Tensor,
    targets: Tensor,
    losses: Tensor,
    wrt: list[Tensor],
    recorder: Recorder,
    options: dict[str, Any],
) -> None:
    """The backward passes of one batch; the recorder collects the output gradients."""
    loss: Loss = options["loss"]
    backward: Backward = options["backward"]
    rider: SharedPassDiagonal | None = options["rider"]
    if options["fisher"] == "empirical" and (rider is None or not rider.needs_vectors):
        # the loss's own backward: the gradient it brings to the outputs is bit for bit the
        # vector ∂(Σ_i ℓ_i)/∂f below, without forming it (a second loss pass and a product)
        recorder.collect(losses.sum(), wrt, rider=rider)
    elif options["fisher"] == "empirical":  # the same pass, as the vector ∂(Σ_i ℓ_i)/∂f
        vector = loss_gradient(outputs.detach(), targets, loss, batch=options["batch"])
        recorder.collect_vectors(outputs, [vector], wrt, 1.0, backward, rider)
    elif options["fisher"] == "mc":
        k, f = options["mc_samples"], outputs.detach()
        draws = (sample_targets(f, targets, loss, options["generator"]) for _ in range(k))
        vectors = (loss_gradient(f, y, loss, batch=options["batch"]) for y in draws)
        recorder.collect_vectors(outputs, vectors, wrt, 1.0 / k, backward, rider)
    else:  # column c of S from every position at once (gradmerge.estimate.kfac, "ggn")
        hessian = OutputHessian(outputs, targets, loss)
        columns = (hessian.column(c) for c in range(hessian.classes))
        recorder.collect_vectors(outputs, columns, wrt, 1.0, backward)


def check_ggn_size(outputs: Tensor, max_ggn_columns: int) -> None:
    columns = 1 if outputs.ndim == 1 else outputs.shape[-1]
    if columns > max_ggn_columns:
        raise ArgumentError(
            f"fisher='ggn' needs one backward pass per output column, here {columns} (> "
            f"max_ggn_columns={max_ggn_columns}); use fisher='mc' (one pass per sample) or "
            "raise max_ggn_columns"
        )
