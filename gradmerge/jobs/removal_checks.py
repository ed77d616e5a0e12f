"""A removal's two checks, summed unit by unit as the engine computes: how far the step went
(:class:`StepSize`) and how much Eq. 13 amplifies the rounding of its inputs (:class:`Rounding`).

The engine (:mod:`gradmerge.jobs.engine`) checks both before it publishes the output
(``step_check``/``max_relative_step``, ``rounding_check``/``max_rounding``: docs/config.md) and
writes them in the record; ``--dry-run`` (:mod:`gradmerge.jobs.conditioning`) computes the same
figures without writing.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradmerge.elementwise import removal as elementwise_removal
from gradmerge.errors import InputWarning, StepTooLargeError


@dataclass
class StepSize:
    """‖θ_\\t − θ_LLM‖ of a removal against a reference norm, summed unit by unit.

    The reference is the task vector ‖θ_t − θ_LLM‖ (Eq. 13) or the weights ‖θ_LLM‖ (Koh &
    Liang). A ratio far above 1 means a direction where the remaining curvature H̄_\\t is near
    zero has exploded (H̄_\\t⁻¹ multiplies by up to 1/δ there).

    Example:
        >>> import torch
        >>> s = StepSize("the task vector ‖θ_t − θ_LLM‖")
        >>> s.add({"w": torch.tensor([3.0, 4.0])}, {"w": torch.tensor([0.0, 1.0])})
        >>> s.ratio
        5.0
    """

    reference: str
    step_sq: float = 0.0
    reference_sq: float = 0.0

    def add(self, step: Mapping[str, Tensor], reference: Mapping[str, Tensor]) -> None:
        """Add one unit's step and reference tensors (same keys)."""
        for k, v in step.items():
            self.step_sq += float(v.double().square().sum())
            self.reference_sq += float(reference[k].double().square().sum())

    @property
    def ratio(self) -> float:
        """‖step‖ / ‖reference‖ (inf for a non-zero step against a zero reference)."""
        if self.reference_sq == 0.0:
            return 0.0 if self.step_sq == 0.0 else math.inf
        return math.sqrt(self.step_sq / self.reference_sq)

    def describe(self) -> str:
        """One line: the step's norm, and its ratio to the reference."""
        return (
            f"removal step ‖θ_\\t − θ_LLM‖ = {math.sqrt(self.step_sq):.4g}, {self.ratio:.3g}× "
            f"{self.reference} ({math.sqrt(self.reference_sq):.4g})"
        )

    def check(self, policy: str, limit: float) -> None:
        """Refuse (``policy`` "refuse": :class:`StepTooLargeError`) or warn ("warn") when the
        ratio exceeds ``limit``; "ignore" does neither."""
        if policy == "ignore" or self.ratio <= limit:
            return
        message = (
            f"the {self.describe()} exceeds `max_relative_step: {limit:g}`: a direction where "
            "the remaining curvature H̄_\\t is near zero exploded. Raise `remaining: {delta: "
            "...}` (the base model's prior precision), add the curvature of the data that stays "
            "to `remaining.curvature`, or set `step_check: warn` to write it anyway"
        )
        if policy == "refuse":
            raise StepTooLargeError(message)
        warnings.warn(message, InputWarning, stacklevel=3)


@dataclass
class Rounding:
    """How much a removal (Eq. 13) amplifies the rounding its inputs carry, summed unit by unit.

    Each input θ is known only to ε/2 relative (ε: the coarser of its stored dtype and the
    compute dtype, in which it is read); where r = |α|(H_0 + H_t)/H̄_\\t is large, Eq. 13
    multiplies that by r (:mod:`gradmerge.elementwise.removal`). The bound ‖e‖₂ is compared with the
    task vector ‖θ_t − θ_LLM‖. Measured for elementwise (diagonal, δ·I) units; ``unmeasured`` counts
    the others (K-FAC, dense), where it is not bounded.

    Example:
        >>> import torch
        >>> from gradmerge.elementwise.removal import RemovalStats
        >>> r = Rounding(torch.float32)
        >>> r.add(RemovalStats(reference_sq=1.0, amplified_sq=4e12, max_ratio=1e6), [torch.float32])
        >>> round(r.bound, 3), r.ratio > 1e-2
        (0.119, True)
    """

    compute: torch.dtype
    bound_sq: float = 0.0
    reference_sq: float = 0.0
    max_ratio: float = 0.0
    eps: float = 0.0
    unmeasured: int = 0

    def add(self, stats: elementwise_removal.RemovalStats, stored: Sequence[torch.dtype]) -> None:
        """Add one unit's measurements; ``stored``: the dtypes its inputs are stored in."""
        eps = max(torch.finfo(d).eps for d in (*stored, self.compute) if d.is_floating_point)
        self.eps = max(self.eps, eps)
        self.bound_sq += (eps / 2) ** 2 * stats.amplified_sq
        self.reference_sq += stats.reference_sq
        self.max_ratio = max(self.max_ratio, stats.max_ratio)

    @property
    def bound(self) -> float:
        """‖e‖₂, the bound on the error the inputs' rounding causes in the result."""
        return math.sqrt(self.bound_sq)

    @property
    def ratio(self) -> float:
        """‖e‖₂ / ‖θ_t − θ_LLM‖ (inf for a non-zero bound against a zero task vector)."""
        if self.reference_sq == 0.0:
            return 0.0 if self.bound_sq == 0.0 else math.inf
        return math.sqrt(self.bound_sq / self.reference_sq)

    def describe(self) -> str:
        """One line: the bound, relative to the task vector, and the largest amplification."""
        kind = "float64" if self.eps <= torch.finfo(torch.float64).eps else "float32 or coarser"
        return (
            f"rounding bound of the removal {self.bound:.3g} = {self.ratio:.3g}× the task vector "
            f"(largest amplification |α|(H_0 + H_t)/H̄_\\t = {self.max_ratio:.3g} of inputs known "
            f"to {kind} precision)"
        )

    def check(self, policy: str, limit: float) -> None:
        """Refuse (:class:`StepTooLargeError`) or warn when the bound exceeds ``limit`` × the task
        vector; "ignore" does neither."""
        if policy == "ignore" or self.ratio <= limit:
            return
        wider = (
            "store θ_LLM and θ_t in float64 and set `compute_dtype: float64` (a float32 merge "
            "has already lost those digits), "
            if self.eps > torch.finfo(torch.float64).eps
            else ""
        )
        message = (
            f"the {self.describe()} exceeds `max_rounding: {limit:g}`: where H̄_\\t is tiny next "
            "to H_0 + H_t (e.g. rows only the removed task trained), Eq. 13 multiplies the "
            "rounding of the stored weights into an error larger than that share of the step. "
            "Re-merge without the task instead (`method: remerge`, exact), "
            f"{wider}raise `remaining: {{delta: ...}}`, or set `rounding_check: warn` to write "
            "it anyway"
        )
        if policy == "refuse":
            raise StepTooLargeError(message)
        warnings.warn(message, InputWarning, stacklevel=3)
