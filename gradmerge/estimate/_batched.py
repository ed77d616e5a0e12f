r"""Backpropagating several output vectors in one pass (the GGN's columns, Monte-Carlo samples).

The exact GGN needs ``Jᵀ v`` for every column ``v`` of the loss Hessian's square root
``S`` (``_output_hessian``), and the Monte-Carlo Fisher for every sampled loss gradient. One
backward pass per vector repeats every layer's transposed-Jacobian product ``R`` times with small
operands. :class:`Backward` instead stacks the ``R`` vectors and runs ONE vmapped backward pass
(``torch.autograd.grad(..., is_grads_batched=True)``), in which each layer applies its transposed
Jacobian to all of them at once (a linear layer: one ``(R·B, out) @ (out, in)`` product) — the
batched backward of BackPACK's ``DiagGGNExact`` and curvlinops' type-2 K-FAC, without their
per-layer extension code. Groups are sized so that the gradients kept stay under a memory budget.

Example:
    >>> import torch
    >>> from gradmerge.estimate._batched import Backward
    >>> w = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    >>> x = torch.ones(1, 2, requires_grad=True)
    >>> f = x @ w.T                                                  # f = W x, Jᵀ v = Wᵀ v
    >>> vs = [torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])]
    >>> Backward().grads(f, [x], vs)[0]                              # (R, *x.shape)
    tensor([[[1., 2.]],
    <BLANKLINE>
            [[3., 4.]]])
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

T = TypeVar("T")

BUDGET_ELEMENTS = 2**25
"""Most gradient elements one group of vectors may produce (128 MiB in float32)."""


class Backward:
    """Backward passes of ``Σ_i v_irᵀ f_i`` for groups of vectors ``v_r``, batched when possible.

    A graph with an operation whose backward cannot be batched (vmap raises) is retried one
    vector at a time, and every later group goes one at a time too (``batched`` becomes False).
    """

    def __init__(self) -> None:
        self.batched = True

    def grads(
        self,
        outputs: Tensor,
        inputs: Sequence[Tensor] | Sequence[GradientEdge],
        vectors: Sequence[Tensor],
        *,
        retain_graph: bool = True,
    ) -> list[Tensor | None]:
        """``∂(Σ_i v_irᵀ f_i)/∂t`` for every input ``t`` (a tensor or a graph edge), stacked over
        the vectors: shape ``(R, *t.shape)``; None for an input that does not reach the outputs.
        """
        if len(vectors) > 1 and self.batched:
            try:
                with warnings.catch_warnings():  # vmap's own per-op fallback stays exact
                    warnings.filterwarnings("ignore", message=".*performance drop.*")
                    return list(
                        torch.autograd.grad(
                            outputs,
                            inputs,
                            grad_outputs=torch.stack(list(vectors)),
                            retain_graph=True,  # a failed attempt must leave the graph
                            allow_unused=True,
                            is_grads_batched=True,
                        )
                    )
            except RuntimeError:  # some backward without a batching rule: one vector at a time
                self.batched = False
        per_vector = [
            torch.autograd.grad(
                # the scalar vᵀf rather than grad_outputs=v: same pass, and autograd's check of
                # grad_outputs imports sympy (~1 s and 33 MB, once per process)
                (outputs * v).sum(),
                inputs,
                retain_graph=retain_graph or r < len(vectors) - 1,
                allow_unused=True,
            )
            for r, v in enumerate(vectors)
        ]
        return [_stack(gs) for gs in zip(*per_vector, strict=True)]


def _stack(grads: tuple[Tensor | None, ...]) -> Tensor | None:
    if grads[0] is None:
        return None
    return grads[0].unsqueeze(0) if len(grads) == 1 else torch.stack(grads)  # type: ignore[arg-type]


def group_size(elements_per_vector: int, budget: int | None = None) -> int:
    """How many vectors fit in one group: ``R · elements_per_vector ≤ budget`` (at least 1;
    default budget :data:`BUDGET_ELEMENTS`)."""
    budget = BUDGET_ELEMENTS if budget is None else budget
    return max(1, budget // max(elements_per_vector, 1))


def groups(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """``items`` in consecutive lists of at most ``size``."""
    group: list[T] = []
    for item in items:
        group.append(item)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group
