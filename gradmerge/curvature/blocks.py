"""Block-diagonal curvature: different structures over disjoint sets of parameters.

A network's curvature is usually mixed: K-FAC for its linear layers, a diagonal for everything
K-FAC does not cover (LayerNorm, embeddings' neighbours, ...). ``Blocks`` is their direct sum:
``mv`` and ``solve`` act block by block, and sums of two ``Blocks`` over the same partition add
block by block (so every block keeps its exact structure).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradmerge.curvature.base import Curvature, IncompatibleStructures
from gradmerge.curvature.identity import ScaledIdentity
from gradmerge.errors import StructureError
from gradmerge.params import Layout, Params
from gradmerge.solvers.solution import Result, Solution
from gradmerge.solvers.spec import Solver


class Blocks(Curvature):
    """The direct sum of curvatures over disjoint parameter sets.

    Example:
        >>> import torch, gradmerge as gm
        >>> K = gm.KFAC({"fc": (torch.eye(2), torch.eye(1))})          # fc.weight: (1, 2)
        >>> D = gm.Diagonal({"norm.weight": torch.tensor([4.0])})
        >>> C = gm.Blocks([K, D]) + 1.0
        >>> C.solve({"fc.weight": torch.ones(1, 2), "norm.weight": torch.ones(1)})["norm.weight"]
        tensor([0.2000])
    """

    rank = 4

    def __init__(self, blocks: Sequence[Curvature]) -> None:
        if not blocks:
            raise StructureError("Blocks needs at least one block")
        seen: dict[str, int] = {}
        for i, block in enumerate(blocks):
            if block.layout is None:
                raise StructureError(
                    f"block {i} ({block!r}) covers no particular parameters; add δ·I to the "
                    "whole Blocks curvature instead (Blocks + δ)"
                )
            for key, _ in block.layout:
                if key in seen:
                    raise StructureError(f"parameter {key!r} is in blocks {seen[key]} and {i}")
                seen[key] = i
        self.blocks = list(blocks)

    def __repr__(self) -> str:
        return f"Blocks({', '.join(repr(b) for b in self.blocks)})"

    @property
    def layout(self) -> Layout:
        return tuple(item for b in self.blocks for item in (b.layout or ()))

    def _like(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for b in self.blocks:
            out.update(b._like())
        return out

    def _dtype_device(self) -> tuple[torch.dtype | None, torch.device | None]:
        return self.blocks[0]._dtype_device()

    def _components(self) -> list[Curvature]:
        return self.blocks

    def _parts(self, v: Params) -> list[dict[str, Tensor]]:
        self.check_covers(v, name="the vector", ref_name="the vector")
        return [{k: v[k] for k, _ in (b.layout or ())} for b in self.blocks]

    def mv(self, v: Params) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for block, part in zip(self.blocks, self._parts(v), strict=True):
            out.update(block.mv(part))
        return out

    def solve(self, v: Params) -> dict[str, Tensor]:
        return self.solve_info(v).value

    def solve_info(
        self, v: Params, solver: Solver | None = None, *, guess: Params | None = None
    ) -> Solution:
        """Each block's :meth:`solve_info` with the same ``solver``; the parts are the blocks' own
        parts (e.g. K-FAC layers), or the block itself under its index."""
        out: dict[str, Tensor] = {}
        parts: dict[str, Solution] = {}
        guesses = self._parts(guess) if guess is not None else [None] * len(self.blocks)
        for i, (block, part, start) in enumerate(
            zip(self.blocks, self._parts(v), guesses, strict=True)
        ):
            solution = block.solve_info(part, solver, guess=start)
            out.update(solution.value)
            parts.update(solution.parts or {f"block{i}": solution})
        return Solution(
            out,
            "per block",
            iterations=sum(p.iterations for p in parts.values()),
            residual=max((p.residual for p in parts.values()), default=float("nan")),
            result=Result.of(all(p.success for p in parts.values())),
            parts=parts,
        )

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Blocks:
        return Blocks([b.to(device=device, dtype=dtype) for b in self.blocks])

    def scaled(self, c: float) -> Blocks:
        return Blocks([b.scaled(c) for b in self.blocks])

    def min_eigenvalue(self) -> float:
        """The smallest of the blocks' values: exact when every block's is."""
        return min(b.min_eigenvalue() for b in self.blocks)

    @property
    def min_eigenvalue_exact(self) -> bool:
        return all(b.min_eigenvalue_exact for b in self.blocks)

    def _scale(self) -> float:
        return max(b._scale() for b in self.blocks)

    def _add_same(self, other: Curvature) -> Curvature:
        if isinstance(other, _Broadcast):
            return Blocks([b + other.delta for b in self.blocks])
        if not isinstance(other, Blocks) or [dict(b.layout or ()) for b in self.blocks] != [
            dict(b.layout or ()) for b in other.blocks
        ]:
            raise StructureError(
                "cannot add Blocks curvatures whose blocks cover different parameter sets; "
                "build both with the same partition"
            )
        return Blocks([a + b for a, b in zip(self.blocks, other.blocks, strict=True)])

    def _promote(self, other: Curvature) -> Curvature:
        if isinstance(other, ScaledIdentity):
            return _Broadcast(other.delta)
        layout = other.layout or ()
        return Blocks([_restrict(other, dict(b.layout or ()), dict(layout)) for b in self.blocks])


class _Broadcast(ScaledIdentity):
    """δ·I on its way into every block of a sum (internal to ``Blocks + δ``)."""

    rank = 4


def _restrict(other: Curvature, keys: dict, layout: dict) -> Curvature:
    """``other`` restricted to the parameters ``keys`` (only structures without coupling)."""
    from gradmerge.curvature.diagonal import Diagonal

    if isinstance(other, Diagonal):
        subset = {k: other.values[k] for k in keys}
        part = Diagonal._of(subset)
        part._remember_precision(other.coarsest_dtype)
        return part
    raise IncompatibleStructures(
        f"cannot split a {type(other).__name__} curvature into blocks: it couples parameters of "
        "different blocks; add curvatures of the same block structure instead"
    )
