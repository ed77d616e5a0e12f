"""Parameter-dict algebra and structure checks.

A parameter dict (``Params``) maps parameter names to floating-point tensors, like a
``state_dict``. Every merge formula in gradmerge is written over such dicts. This module is the only
place that flattens a dict into one vector (``flatten``/``unflatten``), and the only place that
decides whether two dicts fit together (``check_compatible``).

Example:
    >>> import torch
    >>> from gradmerge import params as P
    >>> a = {"w": torch.ones(2, 2), "b": torch.zeros(2)}
    >>> P.flatten(P.axpy(2.0, a, a))
    tensor([3., 3., 3., 3., 0., 0.])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from gradmerge.errors import (
    DeviceError,
    DTypeError,
    NonFiniteError,
    ResultOverflowError,
    StructureError,
)
from gradmerge.foundation.text import key_list

Params = Mapping[str, Tensor]
"""A mapping from parameter name to tensor (e.g. a model's ``state_dict``)."""

Layout = tuple[tuple[str, torch.Size], ...]
"""Names and shapes in flattening order."""


def layout_of(params: Params) -> Layout:
    """The (name, shape) pairs of ``params`` in its key order: the order ``flatten`` uses."""
    return tuple((k, torch.Size(v.shape)) for k, v in params.items())


def numel(params: Params) -> int:
    """Total number of scalars in ``params``."""
    return sum(v.numel() for v in params.values())


def check_params(params: object, *, name: str, finite: bool = True) -> None:
    """Check that ``params`` is a non-empty dict of finite floating-point tensors on one device.

    ``finite=False`` checks the structure only (no pass over the values), for callers that check
    finiteness while computing (see :mod:`gradmerge.elementwise.matching`).

    Raises:
        TypeError: not a mapping of tensors.
        StructureError: empty.
        DTypeError: a non-floating tensor, or floating tensors of different dtypes.
        DeviceError: tensors on different devices.
        NonFiniteError: a NaN or an infinity (the message names the tensor).
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"{name} must be a dict of tensors (e.g. a state_dict), got {type(params)}")
    if len(params) == 0:
        raise StructureError(f"{name} is empty: expected at least one parameter tensor")
    dtype = device = None
    for key, value in params.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"{name}[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
        if not value.is_floating_point():
            raise DTypeError(
                f"{name}[{key!r}] has dtype {value.dtype}; merging needs floating-point tensors. "
                "Leave integer buffers out of the dict, or convert with .to(torch.float32)."
            )
        if dtype is None:
            dtype, device = value.dtype, value.device
        elif value.dtype != dtype:
            raise DTypeError(
                f"{name} mixes dtypes: {name}[{key!r}] is {value.dtype}, earlier tensors are "
                f"{dtype}. Convert all tensors to one dtype first."
            )
        elif value.device != device:
            raise DeviceError(
                f"{name} mixes devices: {name}[{key!r}] is on {value.device}, earlier tensors on "
                f"{device}. Move all tensors to one device first."
            )
    if finite:
        check_finite(params, name=name)


def check_finite(params: Params, *, name: str) -> None:
    """Raise :class:`NonFiniteError` naming the first tensor that holds a NaN or an infinity."""
    for key, value in params.items():
        if value.is_meta:  # shape-only tensors hold no values to check
            continue
        # fast path: a sum is finite only if every term is (an overflowing sum of finite values
        # falls through to the exact elementwise test); one read, no boolean temporary
        if bool(torch.isfinite(value.sum())) or bool(torch.isfinite(value).all()):
            continue
        bad = int((~torch.isfinite(value)).sum())
        raise NonFiniteError(
            f"{name}[{key!r}] holds {bad} NaN/Inf value(s) of {value.numel()}; "
            "every input must be finite (check the checkpoint or the curvature estimate)."
        )


def check_result_finite(
    result: Params,
    *,
    what: str,
    alphas: Sequence[float] = (),
    small: str = "prior",
    inputs: Sequence[tuple[str, Params]] = (),
) -> None:
    """Raise :class:`ResultOverflowError` if a computed ``result`` holds a NaN or an infinity.

    The first of ``inputs`` (name, dict) holding a NaN/Inf at that key is named instead
    (:class:`NonFiniteError`); when they are
    all finite (or none is given: inputs checked before), the result overflowed its dtype, and
    the message says so with the usual fixes: smaller α, a larger ``small`` precision (the
    ``prior`` δ of a merge, the ``remaining`` δ of a removal), or float64.
    """
    for key, value in result.items():
        if bool(torch.isfinite(value.sum())) or bool(torch.isfinite(value).all()):
            continue
        for name, params in inputs:
            if key in params:
                check_finite({key: params[key]}, name=name)
        dtype = str(value.dtype).removeprefix("torch.")
        largest = f" (largest |α| = {max(abs(a) for a in alphas):.3e})" if alphas else ""
        wider = (
            "compute in float64 (float64 tensors and curvatures)"
            if value.dtype != torch.float64
            else "float64 is the widest dtype"
        )
        raise ResultOverflowError(
            f"the {what} {key!r} overflowed {dtype} to Inf/NaN although every input is "
            f"finite{largest}: the α-weighted task vectors over H̄ exceed {dtype}'s range. Use "
            f"smaller α, a larger `{small}` δ, or {wider}."
        )


def detached(params: Params) -> dict[str, Tensor]:
    """``params`` with every tensor detached from autograd (the same memory; merges are not
    differentiable, and in-place kernels refuse tensors that require grad)."""
    return {k: v.detach() for k, v in params.items()}


def check_compatible(reference: Params, other: Params, *, ref_name: str, name: str) -> None:
    """Check that ``other`` has exactly the keys, shapes, dtype and device of ``reference``.

    Both must already have passed :func:`check_params` (or be otherwise known to be uniform).

    Raises:
        StructureError: missing or unexpected keys, or a shape that differs (the key is named).
        DTypeError, DeviceError: a different dtype or device than ``reference``.
    """
    ref_keys, keys = set(reference), set(other)
    if ref_keys != keys:
        missing = [k for k in reference if k not in keys]
        extra = [k for k in other if k not in ref_keys]
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s) of {ref_name}: {key_list(missing)}")
        if extra:
            parts.append(f"{len(extra)} key(s) not in {ref_name}: {key_list(extra)}")
        raise StructureError(
            f"{name} does not match {ref_name}: {'; '.join(parts)}. Every input must cover the same "
            "parameters; select the shared keys (or add the missing ones) before merging."
        )
    for key, ref in reference.items():
        value = other[key]
        if value.shape != ref.shape:
            raise StructureError(
                f"{name}[{key!r}] has shape {tuple(value.shape)} but {ref_name}[{key!r}] has "
                f"{tuple(ref.shape)}: the inputs do not come from the same architecture."
            )
        if value.dtype != ref.dtype:
            raise DTypeError(
                f"{name}[{key!r}] is {value.dtype} but {ref_name}[{key!r}] is {ref.dtype}; "
                "convert every input to one dtype (e.g. float32) before merging."
            )
        if value.device != ref.device:
            raise DeviceError(
                f"{name}[{key!r}] is on {value.device} but {ref_name}[{key!r}] is on "
                f"{ref.device}; move every input to one device (curvatures with .to(device))."
            )


def flatten(params: Params, layout: Layout | None = None) -> Tensor:
    """Concatenate the tensors of ``params`` into one vector, in ``layout`` order (default: key
    order).

    Raises:
        StructureError: ``params`` does not have the keys and shapes of ``layout``.
    """
    if layout is None:
        return torch.cat([v.reshape(-1) for v in params.values()])
    if len(params) != len(layout) or any(
        k not in params or params[k].shape != s for k, s in layout
    ):
        expected = {k: tuple(s) for k, s in layout}
        got = {k: tuple(v.shape) for k, v in params.items()}
        raise StructureError(f"cannot flatten: expected keys and shapes {expected}, got {got}")
    return torch.cat([params[k].reshape(-1) for k, _ in layout])


def unflatten(vector: Tensor, layout: Layout) -> dict[str, Tensor]:
    """Split a vector back into a dict with the names and shapes of ``layout`` (inverse of
    flatten)."""
    total = sum(s.numel() for _, s in layout)
    if vector.ndim != 1 or vector.numel() != total:
        raise StructureError(
            f"cannot unflatten a tensor of shape {tuple(vector.shape)} into {total} parameters"
        )
    out: dict[str, Tensor] = {}
    offset = 0
    for key, shape in layout:
        n = shape.numel()
        out[key] = vector[offset : offset + n].reshape(shape)
        offset += n
    return out


def zeros_like(params: Params) -> dict[str, Tensor]:
    """A dict of zero tensors with the keys, shapes, dtype and device of ``params``."""
    return {k: torch.zeros_like(v) for k, v in params.items()}


def add(a: Params, b: Params) -> dict[str, Tensor]:
    """``a + b`` key by key."""
    return {k: a[k] + b[k] for k in a}


def sub(a: Params, b: Params) -> dict[str, Tensor]:
    """``a − b`` key by key (e.g. a task vector θ_t − θ_LLM)."""
    return {k: a[k] - b[k] for k in a}


def scale(c: float, a: Params) -> dict[str, Tensor]:
    """``c · a`` key by key."""
    return {k: c * v for k, v in a.items()}


def axpy(c: float, x: Params, y: Params) -> dict[str, Tensor]:
    """``y + c · x`` key by key, fused (one pass, no temporary)."""
    return {k: torch.add(y[k], x[k], alpha=c) for k in y}


def dot(a: Params, b: Params) -> Tensor:
    """Euclidean inner product ``Σ_k <a_k, b_k>`` as a 0-dim tensor."""
    return sum((torch.sum(a[k] * b[k]) for k in a), start=torch.zeros((), dtype=_dtype(a)))


def norm(a: Params) -> float:
    """Euclidean norm over all tensors of ``a``."""
    return float(sum(float(torch.sum(v.double() ** 2)) for v in a.values()) ** 0.5)


def distance(a: Params, b: Params) -> float:
    """``‖a − b‖₂`` over all parameters."""
    return norm(sub(a, b))


def relative_distance(a: Params, b: Params) -> float:
    """``‖a − b‖₂ / ‖b‖₂`` (``b`` is the reference); ``‖a − b‖₂`` when ``b`` is zero."""
    ref = norm(b)
    return distance(a, b) / ref if ref > 0 else distance(a, b)


def _dtype(a: Params) -> torch.dtype:
    return next(iter(a.values())).dtype
