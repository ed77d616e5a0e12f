"""A bfloat16 unit merged without widening its inputs in memory (:func:`attempt`).

A job computing in float32 on bfloat16 inputs with a bfloat16 output would read every input
tensor into a float32 copy, run the elementwise merge, then round the float32 result back to
bfloat16 and scan it for overflow: three conversions and a scan that cost more CPU than the merge.
Instead the engine first hands the unit's tensors *as stored* to the method's own rule, with a
kernel (:class:`Widened`) that takes each tensor to the C loop's widened form
(:func:`gradmerge.kernels.fused.merge_widened`): each bfloat16 is widened to float32 in
registers, the loop computes exactly what the float32 loop computes, and θ is rounded to
bfloat16 as ``.to(torch.bfloat16)`` rounds it, checked for ±Inf in the same loop. The result is
bit for bit the float32 path's.

The attempt is accepted only when every output tensor came from that loop, computed from the
inputs as read (no tensor the rule derived in bfloat16 arithmetic, e.g. a scaled curvature or a
prior formed from a file, and nothing the chunked bfloat16 pass computed). Anything else — a
tensor the loop declines, an uncertified result (NaN/Inf, H̄ ≤ 0, h < 0, overflow of bfloat16),
any error of the rule — returns ``None``, and the caller computes the unit on the float32 path,
which gives the result or names the fault exactly as without this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeGuard

import torch
from torch import Tensor

from gradmerge.curvature import Diagonal
from gradmerge.curvature.diagonal import ShiftedDiagonal
from gradmerge.elementwise.matching import H, TensorMerge, tensors
from gradmerge.kernels import fused
from gradmerge.methods.base import MergeUnit, Solved

DTYPE = torch.bfloat16
"""The stored dtype the widened loop takes (inputs and output)."""


class Declined(Exception):
    """The widened loop did not take a tensor (the unit goes to the float32 path)."""


class Widened:
    """The widened C loop as a :class:`gradmerge.elementwise.matching.Kernel` restricted to the
    tensors ``inputs`` (as read from the job's files): any other tensor, or an uncertified
    result, raises :class:`Declined`; :attr:`made` holds the ids of the tensors it wrote."""

    def __init__(self, inputs: Sequence[Tensor]) -> None:
        self.inputs = {_identity(x) for x in inputs}
        self.made: set[int] = set()

    def for_call(self, numels: Sequence[int]) -> TensorMerge:
        return self.merge

    def merge(
        self, base: Tensor, finetuned: Sequence[Tensor], alphas: Sequence[float], h: Sequence[H]
    ) -> Tensor:
        if any(_identity(x) not in self.inputs for x in [base, *finetuned, *tensors(h)]):
            raise Declined("a tensor not read as stored")
        out = fused.merge_widened(base, finetuned, alphas, h)
        if out is None:
            raise Declined("not taken or not certified")
        self.made.add(id(out))
        return out


def attempt(rule: Callable[[MergeUnit], Solved], unit: MergeUnit) -> Solved | None:
    """``rule`` on ``unit`` (its tensors as stored) with the widened loop as its kernel, when
    every tensor it returns was written by that loop from the unit's own bfloat16 tensors (the
    base's, the models' and the diagonal curvatures' values); else ``None`` (module docstring)."""
    inputs = [*unit.base.values(), *(x for ft in unit.finetuned for x in ft.values())]
    inputs += [x for c in unit.curvatures if _plain(c) for x in c.values.values()]
    if any(x.dtype != DTYPE or x.device.type != "cpu" for x in inputs):
        return None
    kernel = Widened(inputs)
    try:
        out, solution = rule(replace(unit, kernel=kernel))
    except Exception:  # the float32 path reruns the unit and names any fault
        return None
    if not out or any(id(x) not in kernel.made for x in out.values()):
        return None
    return out, solution


def _plain(c: object) -> TypeGuard[Diagonal]:
    """Whether ``c`` is a diagonal curvature whose values are held, not formed on use."""
    return isinstance(c, Diagonal) and not isinstance(c, ShiftedDiagonal)


def _identity(x: Tensor) -> tuple[int, int, torch.dtype, bool]:
    """Where ``x``'s elements lie (a view sharing an input's memory is that input)."""
    return (x.data_ptr(), x.numel(), x.dtype, x.is_contiguous())
