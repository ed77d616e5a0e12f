"""Eq. 6 for elementwise curvatures as ONE compiled loop over memory.

The chunked pass of :mod:`gradmerge.elementwise.matching` calls ~20 torch operations per chunk; each
is a separate sweep over the chunk, so on a CPU it reaches ~0.1–0.2 of the memory bandwidth.
A compiled loop reads θ_LLM, every θ_t and h_t once and writes θ once, and in the same loop
certifies the result: no NaN/Inf, H̄ positive, every h ≥ 0 (otherwise the caller re-runs the
tensor on the chunked path, whose exact checks name the culprit). Two backends build it, for
each *pattern* (the number of tasks T and which of H_0, H_1..H_T are tensors rather than δ·I):

- float32/float64 tensors on a CPU: :mod:`gradmerge.kernels.native`, a C loop built by the system C
  compiler once per machine (cached on disk; far cheaper than ``torch.compile``), for every
  tensor of :data:`gradmerge.kernels.native.MIN_NUMEL` elements or more;
- other devices (Triton on a GPU) and dtypes: ``torch.compile`` (inductor) of a generated
  Python function of the whole tensor, which writes NaN wherever H̄ ≤ 0 or some h < 0 and
  returns the sum of the result (a finite sum certifies the tensor). Compiling costs seconds
  once per process and pattern, so it runs only for tensors of :data:`MIN_NUMEL` or more in
  large calls (below).

The operations are those of the chunked path in the same order (``(H_0 + α_1 H_1) + α_2 H_2 …``,
``α_t (H_0 τ_t + H_t τ_t)`` added in turn, ``rhs / H̄``, ``θ_LLM + …``), each rounded once, so
the result is bit-identical to it (and to the operator algebra) on a CPU; tested.

Who takes them: a merge given ``kernel=Fused(mode)``, and the streaming engine and the in-memory
rules by default (``kernel=`` not given; ``None`` takes none), which pick the kernel with
:func:`select` from the mode in force (``$GRADMERGE_FUSED``, or :func:`fused_kernels` around the
run):

- ``"off"``: never;
- ``"on"``: every tensor of :data:`MIN_NUMEL` elements or more (the C loop: of
  :data:`gradmerge.kernels.native.MIN_NUMEL` or more);
- ``"auto"`` (default): the C loop as in ``"on"``; ``torch.compile`` only in calls (and
  streamed jobs) whose tensors of :data:`MIN_NUMEL` or more hold :data:`AUTO_MIN_WORK`
  elements in all, where its compile pays off (the measured break-even is in
  ``benchmarks/README.md``).

Where building fails (no C compiler, no Triton), a ``RuntimeWarning`` says so once and the
chunked path is used.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import cast

import torch
from torch import Tensor

from gradmerge.elementwise.matching import Affine, H, tensors
from gradmerge.errors import ArgumentError
from gradmerge.kernels import memory, native

MIN_NUMEL = 1 << 22
"""Tensors from this many elements on are merged by a compiled kernel (16 MiB in float32)."""

AUTO_MIN_WORK = 1 << 29
"""In ``"auto"`` mode, the elements (in tensors of ``MIN_NUMEL`` or more) a call or job must hold
for compiling to pay off: the compiled loop saves a fixed time per element over the chunked path
and a first compile costs a fixed time (both measured in ``benchmarks/README.md``)."""

MODES = ("auto", "on", "off")
ENV = "GRADMERGE_FUSED"
_mode: ContextVar[str | None] = ContextVar("gradmerge_fused_mode", default=None)
_failed: dict[object, str] = {}


def mode() -> str:
    """The mode in force: :func:`fused_kernels`'s, else ``$GRADMERGE_FUSED``, else ``"auto"``."""
    current = _mode.get()
    if current is not None:
        return current
    return _checked(os.environ.get(ENV, "auto").strip().lower() or "auto", source=f"${ENV}")


@contextmanager
def fused_kernels(mode: str) -> Iterator[None]:
    """Choose, within the block, when merges use compiled single-loop kernels: the mode
    :func:`select` reads, for streamed merges (``gm.run_merge``, ``gradmerge merge``) and the
    in-memory rules' default ``kernel=``.

    ``"on"``, ``"off"`` or ``"auto"`` (module docstring). Results are the same either way. An
    in-memory rule given ``kernel=`` (``None``, or a :class:`Fused`) takes that instead.

    Example:
        >>> with fused_kernels("off"):
        ...     select() is None
        True
        >>> with fused_kernels("on"):
        ...     select()
        Fused('on')
    """
    token = _mode.set(_checked(mode, source="fused_kernels"))
    try:
        yield
    finally:
        _mode.reset(token)


def wanted(numels: Iterable[int], mode: str) -> bool:
    """Whether a call on tensors of these sizes, in ``mode``, uses compiled kernels for its
    large tensors (``"auto"``: when they hold :data:`AUTO_MIN_WORK` elements in all)."""
    return mode == "on" or (mode == "auto" and _work(numels) >= AUTO_MIN_WORK)


def takes(base: Tensor, others: Sequence[Tensor], large_call: bool) -> bool:
    """Whether a compiled loop merges the tensor ``base`` (``others``: the θ_t and tensor h_t
    at its key; ``large_call``: :func:`wanted` for the whole call)."""
    if native.supports(base, others):
        return base.numel() >= native.MIN_NUMEL and "native" not in _failed
    return large_call and base.numel() >= MIN_NUMEL


class Fused:
    """The compiled kernels as a :class:`gradmerge.elementwise.matching.Kernel`: give it to a merge
    (``kernel=``) to take them there.

    ``mode``: ``"on"`` (every tensor large enough, module docstring) or ``"auto"`` (the C loop
    as in ``"on"``; ``torch.compile`` only in calls whose large tensors hold
    :data:`AUTO_MIN_WORK` elements). Results are the same as without it, bit for bit.

    Example:
        >>> import torch, gradmerge as gm
        >>> base, ft = {"w": torch.zeros(3)}, {"w": torch.ones(3)}
        >>> gm.task_arithmetic(base, [ft], kernel=Fused("on"))
        {'w': tensor([1., 1., 1.])}
    """

    def __init__(self, mode: str = "auto") -> None:
        if mode not in ("auto", "on"):
            raise ArgumentError(
                f"Fused(mode) takes 'auto' or 'on', got {mode!r} (for no kernel pass kernel=None)"
            )
        self.mode = mode

    def __repr__(self) -> str:
        return f"Fused({self.mode!r})"

    def for_call(self, numels: Sequence[int]) -> Callable[..., Tensor | None]:
        """The per-tensor evaluator of a call on tensors of these sizes."""
        large_call = wanted(numels, self.mode)

        def merge(
            base: Tensor, finetuned: Sequence[Tensor], alphas: Sequence[float], h: Sequence[H]
        ) -> Tensor | None:
            if not takes(base, [*finetuned, *tensors(h)], large_call):
                return None
            return merge_tensor(base, finetuned, alphas, h)

        return merge


def select(numels: Iterable[int] = ()) -> Fused | None:
    """The kernel a streamed job (and, by default, an in-memory rule's call) takes, from the mode
    in force (:func:`mode`): none when ``"off"``; ``Fused("on")`` when ``"on"``, or when
    ``"auto"`` and the whole job (tensors of these sizes) is large enough that compiling pays off
    though each of its calls (one unit) would not be; else ``Fused("auto")``."""
    current = mode()
    if current == "off":
        return None
    return Fused("on" if wanted(numels, current) else "auto")


def merge_tensor(
    base: Tensor,
    finetuned: Sequence[Tensor],
    alphas: Sequence[float],
    h: Sequence[H],
) -> Tensor | None:
    """Eq. 6 for one tensor by a compiled kernel, or ``None``: no kernel for this device, or the
    result is not certified (then the caller's chunked path decides what is wrong). An
    :class:`~gradmerge.elementwise.matching.Affine` h is formed in the C loop; ``torch.compile``'s
    kernel takes it formed (``form()``)."""
    if native.supports(base, [*finetuned, *tensors(h)]):
        return _native(base, finetuned, alphas, h)
    formed = [x.form() if isinstance(x, Affine) else x for x in h]
    pattern = tuple(isinstance(x, Tensor) for x in formed)
    if not any(pattern) and _scalar_denominator(alphas, formed) <= 0:
        return None  # H̄ = c·I with c ≤ 0: the chunked path raises
    key = (pattern, base.dtype, base.device.type)
    if key in _failed:
        return None
    out = memory.empty(base.shape, like=base)
    flat = [x.reshape(-1) if isinstance(x, Tensor) else float(x) for x in formed]
    args = [out.reshape(-1), base.reshape(-1), *(f.reshape(-1) for f in finetuned), *flat]
    try:
        total = _kernel(pattern)(*args, *(float(a) for a in alphas))
    except Exception as err:  # compiling failed (no compiler, no Triton, ...)
        _warn_failed(key, err, f"{base.dtype} on {base.device.type}")
        return None
    return out if bool(torch.isfinite(total)) else None


def merge_widened(
    base: Tensor,
    finetuned: Sequence[Tensor],
    alphas: Sequence[float],
    h: Sequence[H],
) -> Tensor | None:
    """Eq. 6 for one bfloat16 tensor computed in float32 by the C loop, θ written in bfloat16:
    bit for bit :func:`merge_tensor` of the tensors widened to float32, then
    ``.to(torch.bfloat16)``, without either conversion in memory. ``None`` where the loop does
    not take these tensors (:func:`gradmerge.kernels.native.supports` with ``widened=True``),
    cannot be built, or does not certify the result (as :func:`merge_tensor`, and a θ that
    rounds to ±Inf in bfloat16): the caller then takes the float32 path, which names the fault.

    Example:
        >>> import torch
        >>> b, f = torch.zeros(8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
        >>> out = merge_widened(b, [f], [0.5], [1.0, 0.0])  # task arithmetic: θ = b + 0.5·(f − b)
        >>> out is None or (out.dtype, out.tolist()) == (torch.bfloat16, [0.5] * 8)
        True
    """
    if not native.supports(base, [*finetuned, *tensors(h)], widened=True):
        return None
    return _native(base, finetuned, alphas, h)


def _native(
    base: Tensor, finetuned: Sequence[Tensor], alphas: Sequence[float], h: Sequence[H]
) -> Tensor | None:
    """:func:`gradmerge.kernels.native.merge_tensor`, or ``None`` where it cannot be built (said
    once, then not tried again)."""
    if "native" in _failed:
        return None
    try:
        return native.merge_tensor(base, finetuned, alphas, h)
    except (RuntimeError, OSError) as err:  # no C compiler, a read-only file system, ...
        _warn_failed("native", err, f"{base.dtype} on cpu (C compiler)")
        return None


def _warn_failed(key: object, err: Exception, what: str) -> None:
    """Remember that the kernel under ``key`` cannot be built, and say so once."""
    _failed[key] = f"{type(err).__name__}: {str(err).strip()[:300]}"
    warnings.warn(
        f"gradmerge could not compile its fused diagonal-merge kernel for {what} "
        f"({_failed[key]}); using the slower chunked path. Set {ENV}=off to skip the attempt.",
        RuntimeWarning,
        stacklevel=5,
    )


def _checked(value: str, *, source: str) -> str:
    if value not in MODES:
        raise ArgumentError(f"{source}: expected one of {', '.join(MODES)}, got {value!r}")
    return value


def _work(numels: Iterable[int]) -> int:
    return sum(n for n in numels if n >= MIN_NUMEL)


def _scalar_denominator(alphas: Sequence[float], h: Sequence[float | Tensor]) -> float:
    den = float(h[0])
    for alpha, x in zip(alphas, h[1:], strict=True):
        den = den + alpha * float(x)
    return den


@functools.cache
def _kernel(pattern: tuple[bool, ...]) -> Callable[..., Tensor]:
    """The compiled kernel of one pattern (``pattern[i]``: whether h_i is a tensor).

    Arguments: out, θ_LLM, θ_1..θ_T, h_0..h_T (tensors or floats), α_1..α_T; writes θ into
    ``out`` and returns the sum of what it wrote. Each pattern gets its own function object (so
    its own compile cache); dynamic shapes, so one compile serves every size.
    """
    tasks = len(pattern) - 1
    thetas = [f"f{t}" for t in range(tasks)]
    hs = [f"h{i}" for i in range(tasks + 1)]
    alphas = [f"a{t}" for t in range(tasks)]
    lines = ["den = h0"]  # H̄ = (H_0 + α_1 H_1) + α_2 H_2 + …
    for t in range(tasks):
        term = f"({hs[t + 1]} * {alphas[t]})" if pattern[t + 1] else f"({alphas[t]} * {hs[t + 1]})"
        lines.append(f"den = den + {term}")
    for t in range(tasks):  # rhs = Σ_t α_t (H_0 τ_t + H_t τ_t), τ_t = θ_t − θ_LLM   (Eq. 6)
        lines.append(f"tau = {thetas[t]} - b")
        lines.append(f"term = (tau * h0 + tau * {hs[t + 1]}) * {alphas[t]}")
        lines.append("rhs = term" if t == 0 else "rhs = rhs + term")
    lines.append("theta = b + rhs / den")
    checks = (["(den > 0)"] if any(pattern) else []) + [
        f"({name} >= 0)" for name, is_tensor in zip(hs, pattern, strict=True) if is_tensor
    ]
    if checks:
        lines.append(f"theta = torch.where({' & '.join(checks)}, theta, float('nan'))")
    lines += ["out.copy_(theta)", "return theta.sum()"]
    name = "eq6_" + "".join("h" if p else "d" for p in pattern)
    source = f"def {name}({', '.join(['out', 'b', *thetas, *hs, *alphas])}):\n"
    source += "".join(f"    {line}\n" for line in lines)
    namespace: dict[str, object] = {"torch": torch}
    exec(compile(source, f"<gradmerge.kernels.fused {name}>", "exec"), namespace)
    function = cast(Callable[..., Tensor], namespace[name])
    return torch.compile(function, dynamic=True, fullgraph=True)
