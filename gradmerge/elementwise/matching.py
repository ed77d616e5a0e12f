"""Eq. 6 for elementwise curvatures (diagonal and δ·I), fused and chunked: one pass over memory.

When H_0 and every H_t are diagonal (:class:`Diagonal`) or scaled identities, the merge of Eq. 6
is elementwise,

.. math::

    \\theta = \\theta_{LLM}
        + \\frac{\\sum_t \\alpha_t (h_0 + h_t)\\,(\\theta_t - \\theta_{LLM})}
                {h_0 + \\sum_t \\alpha_t h_t},

and :func:`gradmerge.gradient_matching` (hence task arithmetic and Fisher averaging, its special
cases) evaluates it here, tensor by tensor in chunks of :data:`CHUNK` elements, so that the
intermediates stay in cache and every input is read once — the generic operator algebra would
allocate a full-size temporary per operation and read each input several times. The validation of
values is folded into the same pass: running minima of every h_t (PSD) and of the denominator
(H̄ positive definite), and a running sum of the result (any NaN/Inf input makes the result
non-finite); when one fails, the exact per-input checks run to name the culprit, with the same
errors as the generic path.

A prior δ·I + s·C built lazily (:meth:`gradmerge.Diagonal.shifted`, as the streaming engine
builds it) reaches the C loop as C, s and δ, and h_0 = (s·C) + δ is formed inside the loop (never
written to memory); every other path forms it as the operator algebra does, bit for bit the same.

A caller may hand in a faster evaluator (``kernel``, a :class:`Kernel`: the compiled loops of
:mod:`gradmerge.kernels`; same result bit for bit); a tensor it declines, or whose result comes
out uncertified (a NaN/Inf, H̄ ≤ 0 or h < 0 somewhere), is merged here, with the exact diagnosis.
By default (:data:`SELECTED`) the rules take the kernel the streaming engine takes: the package's
facade plugs the engine's choice in (:func:`gradmerge.kernels.select`, loaded on first use).
This module itself compiles nothing and maps no memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol, cast

import torch
from torch import Tensor

from gradmerge import params as P
from gradmerge.curvature import Curvature, Diagonal, ScaledIdentity
from gradmerge.curvature.diagonal import ShiftedDiagonal
from gradmerge.errors import not_pd
from gradmerge.params import Params

CHUNK = 1 << 16
"""Elements per step on a CPU (256 KiB per float32 buffer): one step's working set stays in
cache."""

DEVICE_CHUNK = 1 << 24
"""Elements per step on other devices (GPUs): each operation is a kernel launch, so steps are
large (64 MiB per float32 buffer), which keeps launches rare and temporaries bounded."""

Part = float | dict[str, Tensor] | ShiftedDiagonal
"""An elementwise curvature: δ (for δ·I), diagonal values per parameter, or a diagonal
δ·I + s·C whose values are not formed yet."""


class Affine(NamedTuple):
    """A curvature's values formed elementwise inside the loop: h = (c·scale) + delta, each
    operation rounded to c's type, as ``Diagonal.scaled(scale) + delta`` rounds it.

    ``form`` returns h as the operator algebra forms it (the tensor), for every path that does
    not take the C loop (the chunked pass, its diagnosis, other devices).
    """

    values: Tensor
    scale: float
    delta: float
    form: Callable[[], Tensor]


H = float | Tensor | Affine
"""One curvature at one tensor: δ (δ·I), the tensor h, or an :class:`Affine` h."""


def tensors(h: Sequence[H]) -> list[Tensor]:
    """The tensors the loop reads for ``h`` (an Affine's ``values``)."""
    return [x.values if isinstance(x, Affine) else x for x in h if isinstance(x, (Tensor, Affine))]


TensorMerge = Callable[[Tensor, Sequence[Tensor], Sequence[float], Sequence[H]], "Tensor | None"]
"""Eq. 6 for one tensor (θ_LLM, the θ_t, the α_t, the h_i at its key), or ``None`` where the
evaluator does not take the tensor or cannot certify its result."""


class Kernel(Protocol):
    """A faster evaluator of the diagonal merge than the chunked pass (:mod:`gradmerge.kernels`).

    Given to :func:`merge` (``kernel=`` of :func:`gradmerge.gradient_matching` and its special
    cases), it is asked once per call for a per-tensor evaluator; every tensor it declines (or
    whose result it does not certify) is merged by the chunked pass, which names what is wrong.
    """

    def for_call(self, numels: Sequence[int]) -> TensorMerge | None:
        """The evaluator for a call on tensors of these sizes (``None``: the chunked pass only)."""
        ...


class Selected:
    """The default ``kernel=`` of the in-memory rules: the kernel the streaming engine would take
    for the same tensors, from the mode in force (``gm.fused_kernels``, ``$GRADMERGE_FUSED``).

    On a CPU that is the C loop for float32/float64 tensors of 4096 elements or more; elsewhere
    ``torch.compile`` only for calls large enough to pay for its compile; with the mode ``"off"``,
    none. Every tensor a kernel takes is certified in its own pass (or merged again here) and is
    bit for bit the chunked pass's; where no kernel can be built (no C compiler), a
    ``RuntimeWarning`` says so once and the chunked pass runs (:mod:`gradmerge.kernels.fused`).

    The choice itself lives outside the core: :attr:`choose` is set by the package's facade
    (``gradmerge/__init__.py``) to :func:`gradmerge.kernels.select`, imported on the first call;
    while it is ``None`` the chunked pass runs. ``kernel=None`` asks for the chunked pass alone.
    """

    choose: Callable[[Sequence[int]], Kernel | None] | None = None

    def for_call(self, numels: Sequence[int]) -> TensorMerge | None:
        """The chosen kernel's evaluator for a call on tensors of these sizes, or ``None``."""
        kernel = self.choose(numels) if self.choose is not None else None
        return kernel.for_call(numels) if kernel is not None else None

    def __repr__(self) -> str:
        return "SELECTED"


SELECTED = Selected()
"""``kernel=`` by default (:class:`Selected`): the engine's choice of kernel for the call."""


def parts(curvature: Curvature) -> Part | None:
    """The elementwise form of ``curvature``, or ``None`` when it is not elementwise."""
    if isinstance(curvature, ScaledIdentity):
        return curvature.delta
    if isinstance(curvature, ShiftedDiagonal) and not curvature.formed:
        return curvature
    if isinstance(curvature, Diagonal):
        return curvature.values
    return None


def merge(
    base: Params,
    finetuned: Sequence[Params],
    alphas: Sequence[float],
    prior: Part,
    curvatures: Sequence[Part],
    *,
    names: Sequence[str],
    precisions: Sequence[torch.dtype | None],
    kernel: Kernel | None = None,
) -> dict[str, Tensor]:
    """Eq. 6 with elementwise H_0 = ``prior`` and H_t = ``curvatures[t]`` (already
    structure-checked).

    ``names`` are the curvatures' argument names for error messages (prior first);
    ``precisions`` their ``coarsest_dtype`` (same order), at which negative values are judged.
    """
    out: dict[str, Tensor] = {}
    minima: list[Tensor | None] = [None] * (1 + len(curvatures))
    fast = kernel.for_call([b.numel() for b in base.values()]) if kernel is not None else None
    for key, b in base.items():
        thetas = [ft[key] for ft in finetuned]
        if fast is not None:
            lazy = [_lazy_at(prior, key), *(_lazy_at(c, key) for c in curvatures)]
            result = fast(b, thetas, alphas, lazy)  # e.g. one compiled loop, certified
            if result is not None:
                out[key] = result
                continue
        h = [_at(prior, key), *(_at(c, key) for c in curvatures)]
        result, den_min, total, h_min = _merge_tensor(b, thetas, alphas, h)
        for i, m in enumerate(h_min):
            if m is not None:
                minima[i] = m if minima[i] is None else torch.minimum(minima[i], m)  # type: ignore[arg-type]
        if float(den_min) <= 0:  # before finiteness: a zero of H̄ also makes the result Inf
            _refuse_singular(key, b, alphas, h, [prior, *curvatures], minima, names, precisions)
        if not bool(torch.isfinite(total)) and not bool(torch.isfinite(result).all()):
            _explain_non_finite(key, result, base, finetuned, h, names, alphas)
        out[key] = result
    _check_psd([prior, *curvatures], minima, names, precisions)
    return out


def _check_psd(
    parts: Sequence[Part],
    minima: Sequence[Tensor | None],
    names: Sequence[str],
    precisions: Sequence[torch.dtype | None],
) -> None:
    """The exact PSD check of the generic path, run only where a negative value was seen."""
    for part, m, name, precision in zip(parts, minima, names, precisions, strict=True):
        if m is not None and float(m) < 0 and not isinstance(part, float):
            values = part.values if isinstance(part, ShiftedDiagonal) else part
            diagonal = Diagonal._of(values)
            diagonal._remember_precision(precision)
            diagonal.check_psd(name=name)


def _refuse_singular(
    key: str,
    base: Tensor,
    alphas: Sequence[float],
    h: Sequence[float | Tensor],
    parts: Sequence[Part],
    minima: Sequence[Tensor | None],
    names: Sequence[str],
    precisions: Sequence[torch.dtype | None],
) -> None:
    """H̄ is not positive definite at ``key``: a non-PSD input first, else the singular system."""
    _check_psd(parts, minima, names, precisions)
    den = _denominator(base, alphas, h)
    if den.dim() == 0:  # every curvature is δ·I
        raise not_pd("δ·I", f"δ = {float(den)}")
    bad = int((den <= 0).sum())
    raise not_pd(
        "diagonal system",
        f"{bad} of {den.numel()} entries of {key!r} are ≤ 0, smallest {float(den.min()):.3e}",
    )


def _at(part: Part, key: str) -> float | Tensor:
    """The curvature at ``key``: δ, or the tensor of values (formed, if they were not yet)."""
    if isinstance(part, ShiftedDiagonal):
        return part.values[key]
    return part if isinstance(part, float) else part[key]


def _lazy_at(part: Part, key: str) -> H:
    """As :func:`_at`, but a diagonal whose values are not formed yet as an Affine for the loop."""
    if isinstance(part, ShiftedDiagonal):
        shifted = part
        c = shifted.unshifted.values[key]
        return Affine(c, shifted.scale, shifted.delta, lambda: shifted.values[key])
    return _at(part, key)


def _merge_tensor(
    base: Tensor,
    finetuned: Sequence[Tensor],
    alphas: Sequence[float],
    h: Sequence[float | Tensor],
) -> tuple[Tensor, Tensor, Tensor, list[Tensor | None]]:
    """One tensor of Eq. 6; returns (result, min of H̄, sum of the result, min of each h).

    Each step evaluates the same floating-point operations, in the same order, as the operator
    algebra (``(H_0 + α_1 H_1) + α_2 H_2 …``, ``H_0 τ + H_t τ``, ``rhs / H̄``, ``θ_LLM + …``),
    so the result is bit-identical to the generic path; only the memory traffic differs.
    """
    flat_b = base.reshape(-1)
    flat_f = [f.reshape(-1) for f in finetuned]
    flat_h = [x.reshape(-1) if isinstance(x, Tensor) else x for x in h]
    h0 = flat_h[0]
    result = torch.empty(flat_b.shape, dtype=flat_b.dtype, device=flat_b.device)
    n = flat_b.numel()
    chunk = CHUNK if base.device.type == "cpu" else DEVICE_CHUNK
    size = min(chunk, n)
    num, den, tau, p, q = (torch.empty(size, dtype=base.dtype, device=base.device) for _ in "12345")

    def like(*shape: int) -> Tensor:
        return torch.full(shape, float("inf"), dtype=base.dtype, device=base.device)

    den_min, total = like(), torch.zeros((), dtype=base.dtype, device=base.device)
    h_min: list[Tensor | None] = [like() if isinstance(x, Tensor) else None for x in flat_h]
    for start in range(0, n, chunk):
        s = slice(start, min(start + chunk, n))
        m = s.stop - s.start
        b, nu, de, ta, pm, qm = flat_b[s], num[:m], den[:m], tau[:m], p[:m], q[:m]
        for i, x in enumerate(flat_h):  # PSD of each diagonal h (checked exactly at the end)
            if isinstance(x, Tensor):
                h_min[i] = torch.minimum(cast(Tensor, h_min[i]), x[s].min())
        # H̄ = (H_0 + α_1 H_1) + α_2 H_2 + …, a Python float while every term is δ·I
        acc: float | Tensor = h0 if isinstance(h0, float) else de.copy_(h0[s])
        for alpha, x in zip(alphas, flat_h[1:], strict=True):
            if isinstance(x, float) and isinstance(acc, float):
                acc = acc + alpha * x
            elif isinstance(x, float):
                cast(Tensor, acc).add_(alpha * x)
            else:
                torch.mul(x[s], alpha, out=qm)
                if isinstance(acc, float):
                    acc = torch.add(qm, acc, out=de)
                else:
                    acc.add_(qm)
        # right-hand side Σ_t α_t (H_0 τ_t + H_t τ_t), τ_t = θ_t − θ_LLM  (Eq. 6)
        nu.zero_()
        for alpha, f, x in zip(alphas, flat_f, flat_h[1:], strict=True):
            torch.sub(f[s], b, out=ta)
            torch.mul(ta, h0 if isinstance(h0, float) else h0[s], out=pm)
            torch.mul(ta, x if isinstance(x, float) else x[s], out=qm)
            pm.add_(qm).mul_(alpha)
            nu.add_(pm)
        # θ_LLM + H̄⁻¹ rhs
        if isinstance(acc, float):
            if acc > 0:
                nu.div_(acc)
        else:
            den_min = torch.minimum(den_min, acc.min())
            nu.div_(acc)
        torch.add(b, nu, out=result[s])
        total += result[s].sum()
    if all(isinstance(x, float) for x in flat_h):
        den_min = torch.tensor(_denominator(base, alphas, h).item())
    return result.reshape(base.shape), den_min, total, h_min


def _denominator(base: Tensor, alphas: Sequence[float], h: Sequence[float | Tensor]) -> Tensor:
    """H̄ = h_0 + Σ_t α_t h_t at one tensor (a 0-dim tensor when every h is a scalar)."""
    den = torch.as_tensor(h[0], dtype=base.dtype, device=base.device)
    for alpha, x in zip(alphas, h[1:], strict=True):
        den = den + alpha * torch.as_tensor(x, dtype=base.dtype, device=base.device)
    return den


def _explain_non_finite(
    key: str,
    result: Tensor,
    base: Params,
    finetuned: Sequence[Params],
    h: Sequence[float | Tensor],
    names: Sequence[str],
    alphas: Sequence[float],
) -> None:
    """Name the input that made the result non-finite (or say that the result overflowed)."""
    inputs = [("base", base), *((f"finetuned[{t}]", ft) for t, ft in enumerate(finetuned))]
    inputs += [(n, {key: x}) for x, n in zip(h, names, strict=True) if isinstance(x, Tensor)]
    P.check_result_finite({key: result}, what="merged", alphas=alphas, inputs=inputs)
