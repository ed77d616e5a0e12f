"""A cheap fingerprint of weight VALUES: a hash of a fixed sample of every tensor.

A curvature is estimated at particular weights (its model's, or the base's); a merge that pairs
it with other weights of the same names and shapes runs, but computes something else. The
header fingerprints (:attr:`Checkpoint.fingerprint`, the curvature's layout fingerprint) see
names and shapes only. This one samples values: from each tensor, up to :data:`ROWS` rows
evenly spaced along the first dimension and, of those, up to :data:`PER_ROW` entries evenly
spaced, rounded to bfloat16 (so a bf16 or fp16 copy of float32 weights matches them) and hashed
with the sorted names and shapes (SHA-256). Reading it from a checkpoint touches at most
ROWS rows per tensor, never whole tensors.

A match does not prove the weights equal (only the sampled entries are compared); a mismatch
proves they differ.

:func:`content_hash` is the provenance fingerprint of a whole checkpoint (``gradmerge_merge.json``
records it for every input): SHA-256 over the sorted names, dtypes and shapes and, per tensor, the
exact stored bytes of the whole tensor when it holds at most :data:`WHOLE` entries, else of
:data:`CONTENT_ROWS` whole rows evenly spaced along the first dimension (first and last
included). No rounding: a change of one bit in a sampled row changes it. It reads at most
CONTENT_ROWS rows per large tensor (e.g. 16 × 768 × 4 B = 48 kB of a GPT-2 embedding), never a
whole large tensor, so two checkpoints that differ only outside the sampled rows of every large
tensor get the same fingerprint; fine-tuning changes (almost) every row, so different fine-tunes
and their base do not.

Example:
    >>> import torch
    >>> w = {"fc.weight": torch.arange(12.0).reshape(3, 4)}
    >>> same = {"fc.weight": w["fc.weight"].double()}
    >>> sample_hash(w, ["fc.weight"]) == sample_hash(same, ["fc.weight"])
    True
    >>> sample_hash(w, ["fc.weight"]) == sample_hash({"fc.weight": w["fc.weight"] + 1}, ["fc.weight"])
    False
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

ROWS = 8
PER_ROW = 8
CONTENT_ROWS = 16
"""Rows per large tensor hashed by :func:`content_hash`."""
WHOLE = 65536
"""Tensors with at most this many entries are hashed whole by :func:`content_hash`."""
CONTENT_HASH_OF = (
    f"values: SHA-256 of names, dtypes, shapes and the exact bytes of every tensor of at most "
    f"{WHOLE} entries and of {CONTENT_ROWS} evenly spaced rows of every larger one"
)
"""What :func:`content_hash` covers, as the merge record states it."""
META_KEY = "weights_sample_sha256"
"""The curvature metadata key (``C.meta``, saved as ``info.`` in files) of the hash."""


def _evenly(n: int, k: int) -> list[int]:
    """Up to ``k`` indices evenly spaced over ``range(n)``, first and last included."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _entries(selected: Tensor) -> Tensor:
    """The sampled entries of the selected rows, as bfloat16 bit patterns."""
    flat = selected.reshape(selected.shape[0], -1) if selected.ndim > 0 else selected.reshape(1, 1)
    cols = _evenly(flat.shape[1], PER_ROW)
    return flat[:, cols].to(torch.bfloat16).contiguous().view(torch.int16).cpu()


def sample_hash_from(
    keys: Iterable[str],
    shape: Callable[[str], tuple[int, ...]],
    rows: Callable[[str, list[int]], Tensor],
) -> str:
    """The hash over ``keys``, reading each tensor's sampled rows with ``rows(key, indices)``
    (``indices`` empty for a 0-dim tensor: the whole value)."""
    digest = hashlib.sha256()
    for key in sorted(keys):
        dims = tuple(shape(key))
        digest.update(f"{key}:{','.join(map(str, dims))};".encode())
        selected = rows(key, _evenly(dims[0], ROWS) if dims else [])
        digest.update(_entries(selected).numpy().tobytes())
    return digest.hexdigest()


def sample_hash(params: Mapping[str, Tensor], keys: Iterable[str]) -> str:
    """The hash of the tensors ``keys`` of ``params`` (a state dict, or named parameters)."""

    def rows(key: str, indices: list[int]) -> Tensor:
        value = params[key].detach()
        return value[indices] if indices else value

    return sample_hash_from(keys, lambda k: tuple(params[k].shape), rows)


def record(curvature: Any, params: Mapping[str, Tensor]) -> None:
    """Store the hash of the weights ``curvature`` was estimated at in ``curvature.meta``
    (over the parameters it covers that ``params`` holds)."""
    layout = curvature.layout or ()
    keys = [k for k, _ in layout if k in params]
    if keys:
        curvature.meta[META_KEY] = sample_hash(params, keys)


def content_hash(
    keys: Iterable[str],
    shape: Callable[[str], tuple[int, ...]],
    dtype: Callable[[str], torch.dtype],
    rows: Callable[[str, list[int]], Tensor],
) -> str:
    """The provenance fingerprint of a checkpoint (module docstring): SHA-256 of the names,
    dtypes, shapes and exact bytes of every small tensor and of :data:`CONTENT_ROWS` rows of every
    large one, read with ``rows(key, indices)`` (``indices`` empty: the whole tensor).

    Example:
        >>> import torch
        >>> w = {"a": torch.zeros(3, 2), "b": torch.ones(200_000, 1)}
        >>> def fingerprint(p):
        ...     return content_hash(p, lambda k: tuple(p[k].shape), lambda k: p[k].dtype,
        ...                         lambda k, i: p[k][i] if i else p[k])
        >>> fingerprint(w) == fingerprint({"a": torch.zeros(3, 2), "b": torch.ones(200_000, 1)})
        True
        >>> fingerprint(w) == fingerprint({"a": torch.zeros(3, 2), "b": torch.full((200_000, 1), 2.0)})
        False
    """
    digest = hashlib.sha256()
    for key in sorted(keys):
        dims = tuple(shape(key))
        kind = str(dtype(key)).removeprefix("torch.")
        digest.update(f"{key}:{kind}:{','.join(map(str, dims))};".encode())
        numel = 1
        for d in dims:
            numel *= d
        whole = not dims or numel <= WHOLE
        value = rows(key, [] if whole else _evenly(dims[0], CONTENT_ROWS)).detach().cpu()
        digest.update(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
