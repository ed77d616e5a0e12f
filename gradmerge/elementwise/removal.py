r"""Eq. 13 for elementwise curvatures, fused and chunked, and what it does to rounding errors.

When H_0, H_t and H̄_\t are diagonal or δ·I, the removal of Eq. 13 is elementwise,

.. math::

    \theta_{\setminus t} = \theta_{LLM}
        - \alpha\,\frac{(h_0 + h_t)(\theta_t - \theta_{LLM})}{\bar h_{\setminus t}},

and :func:`gradmerge.remove` evaluates it here, tensor by tensor in chunks of
:data:`CHUNK` elements, with the same floating-point operations in the same order as the operator
algebra (``h_0 τ + h_t τ``, ``/ h̄``, ``θ_LLM + (−α)·…``): bit for bit the generic result, with
each input read once. The value checks are folded into the pass (minimum
of each curvature, of h̄, the sum of the result); if one fails, the caller reruns the generic path
for its exact diagnosis.

**Rounding.** Each θ stored in a dtype of machine epsilon ε is known only to ε/2 relative. The
removal multiplies the task vector by r_i = |α|(h_0 + h_t)_i / h̄_i, so the result's entry i
carries an error up to

.. math::

    e_i = r_i\,\tfrac{\varepsilon}{2}\,(|\theta_{t,i}| + |\theta_{LLM,i}|)

from the inputs' rounding alone (where h̄ ≪ h_0 + h_t, e.g. embedding rows of tokens only the
removed task saw, r reaches 10¹⁰ and e exceeds the step itself). The pass accumulates
Σ_i [r_i (|θ_t| + |θ_LLM|)_i]², so that ‖e‖₂ = (ε/2)·√(that) for any ε, the largest r_i, and the
norms of the step and of the task vector (:class:`RemovalStats`, returned with the result).
Computing in float64 removes the arithmetic's own rounding, not the rounding the stored inputs
already carry.

Example:
    >>> import torch
    >>> from gradmerge.elementwise.removal import remove
    >>> out, stats = remove({"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}, 1.0,
    ...                     {"w": torch.tensor([1.0])}, 4.0, alpha=1.0)
    >>> out, stats.max_ratio
    ({'w': tensor([0.5000])}, 0.5)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from gradmerge.curvature.diagonal import ShiftedDiagonal
from gradmerge.params import Params

CHUNK = 1 << 16
"""Elements per step (256 KiB per float32 buffer): a step's working set stays in cache."""

Part = float | dict[str, Tensor] | ShiftedDiagonal
"""An elementwise curvature: δ, diagonal values, or δ + s·C not formed yet."""


@dataclass
class RemovalStats:
    """What one elementwise removal did (summed over its tensors).

    Attributes:
        step_sq: ‖θ_\\t − θ_LLM‖² of the result.
        reference_sq: ‖θ_t − θ_LLM‖², the task vector.
        amplified_sq: Σ_i [r_i (|θ_t,i| + |θ_LLM,i|)]²: the squared rounding bound is
            (ε/2)²·amplified_sq for inputs known to relative ε/2 (module docstring).
        max_ratio: the largest r_i = |α|(h_0 + h_t)_i / h̄_i.
    """

    step_sq: float = 0.0
    reference_sq: float = 0.0
    amplified_sq: float = 0.0
    max_ratio: float = 0.0

    def rounding_bound(self, eps: float) -> float:
        """‖e‖₂ for inputs of machine epsilon ``eps``."""
        return eps / 2 * math.sqrt(self.amplified_sq)

    def as_dict(self) -> dict[str, float]:
        """The four figures by name (what a :class:`~gradmerge.Solution` carries as
        ``measured``); ``RemovalStats(**d)`` rebuilds it."""
        return asdict(self)


def _at(part: Part, key: str) -> float | Tensor | tuple[Tensor, float, float]:
    """``part`` at ``key``: a float δ, a tensor, or (C, s, δ) for a lazy δ + s·C."""
    if isinstance(part, ShiftedDiagonal):
        return (
            part.values[key]
            if part.formed
            else (part.unshifted.values[key], part.scale, part.delta)
        )
    return part if isinstance(part, float) else part[key]


def _chunk(term: float | Tensor | tuple[Tensor, float, float], s: slice) -> float | Tensor:
    """The chunk ``s`` of a term, a lazy prior formed as the operator algebra forms it:
    (C·s) + δ."""
    if isinstance(term, tuple):
        c, scale, delta = term
        return torch.mul(c.reshape(-1)[s], scale).add_(delta)
    return term.reshape(-1)[s] if isinstance(term, Tensor) else term


def _min(x: float | Tensor) -> float:
    return float(x.min()) if isinstance(x, Tensor) else x


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run the chunk loop on one intra-op thread: each step is cache-sized, and splitting it
    over threads costs a synchronisation per operation (milliseconds on a loaded machine,
    against microseconds of work)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@_one_thread()
def remove(
    base: Params,
    finetuned: Params,
    prior: Part,
    curvature: Part,
    remaining: Part,
    *,
    alpha: float,
) -> tuple[dict[str, Tensor], RemovalStats] | None:
    """Eq. 13 elementwise (module docstring) and what the pass measured; ``None`` when a value
    check fails somewhere (a curvature entry < 0, h̄ ≤ 0, a NaN/Inf in the result), for the
    caller's exact diagnosis. Inputs' keys, shapes and dtypes are checked by the caller."""
    out: dict[str, Tensor] = {}
    stats = RemovalStats()
    for key, b in base.items():
        h0, ht, rest = _at(prior, key), _at(curvature, key), _at(remaining, key)
        flat_b, flat_f = b.reshape(-1), finetuned[key].reshape(-1)
        n = flat_b.numel()
        result = torch.empty_like(flat_b)
        size = max(1, min(CHUNK, n))
        tau, p, q = (torch.empty(size, dtype=b.dtype, device=b.device) for _ in range(3))
        low, ratio = math.inf, 0.0
        step_sq = ref_sq = amp_sq = 0.0
        for start in range(0, n, CHUNK):
            s = slice(start, min(start + CHUNK, n))
            m = s.stop - s.start
            bs, ta, pm, qm = flat_b[s], tau[:m], p[:m], q[:m]
            a0, at, ar = _chunk(h0, s), _chunk(ht, s), _chunk(rest, s)
            low = min(low, _min(a0), _min(at))
            lo, hi = ar.aminmax() if isinstance(ar, Tensor) else (ar, ar)
            if not (float(lo) > 0 and math.isfinite(float(hi))):  # H̄_\t ≤ 0, or ±Inf/NaN
                return None
            torch.sub(flat_f[s], bs, out=ta)  # τ = θ_t − θ_LLM
            torch.mul(ta, a0, out=pm)  # H_0 τ
            torch.mul(ta, at, out=qm)  # H_t τ
            pm.add_(qm).div_(ar)  # H̄_\t⁻¹ (H_0 τ + H_t τ)
            torch.add(bs, pm, alpha=-alpha, out=result[s])  # Eq. 13
            if not bool(torch.isfinite(result[s].sum())):
                return None
            # the step, the task vector, and the amplification of the inputs' rounding
            torch.sub(result[s], bs, out=qm)
            step_sq += float(torch.dot(qm, qm))
            ref_sq += float(torch.dot(ta, ta))
            r = (a0 + at) / ar * abs(alpha)  # a tensor, or a float when all three are δ·I
            ratio = max(ratio, float(r.max()) if isinstance(r, Tensor) else r)
            torch.abs(flat_f[s], out=pm).add_(bs.abs()).mul_(r)
            amp_sq += float(torch.dot(pm, pm))
        if low < 0:
            return None
        out[key] = result.reshape(b.shape)
        stats.step_sq += step_sq
        stats.reference_sq += ref_sq
        stats.amplified_sq += amp_sq
        stats.max_ratio = max(stats.max_ratio, ratio)
    return out, stats
