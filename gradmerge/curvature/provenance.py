"""Which weights a curvature was estimated at: a cheap hash of a fixed sample of every tensor.

A curvature is estimated at particular weights (its model's, or the base's); a merge that pairs
it with other weights of the same names and shapes runs, but computes something else. The
header fingerprints (:attr:`Checkpoint.fingerprint`, the curvature's layout fingerprint) see
names and shapes only. This one samples values: from each tensor, up to :data:`ROWS` rows
evenly spaced along the first dimension and, of those, up to :data:`PER_ROW` entries evenly
spaced, rounded to bfloat16 (so a bf16 or fp16 copy of float32 weights matches them) and hashed
with the sorted names and shapes (SHA-256). Reading it from a checkpoint touches at most
ROWS rows per tensor, never whole tensors. The estimators record it in ``C.meta`` under
:data:`META_KEY` (:func:`record`); the merge engine compares it with its inputs.

A match does not prove the weights equal (only the sampled entries are compared); a mismatch
proves they differ. The exact provenance fingerprint of a whole checkpoint is
:func:`gradmerge.io.fingerprint.content_hash`.

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
META_KEY = "weights_sample_sha256"
"""The curvature metadata key (``C.meta``, saved as ``info.`` in files) of the hash."""


def evenly(n: int, k: int) -> list[int]:
    """Up to ``k`` indices evenly spaced over ``range(n)``, first and last included."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _entries(selected: Tensor) -> Tensor:
    """The sampled entries of the selected rows, as bfloat16 bit patterns."""
    flat = selected.reshape(selected.shape[0], -1) if selected.ndim > 0 else selected.reshape(1, 1)
    cols = evenly(flat.shape[1], PER_ROW)
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
        selected = rows(key, evenly(dims[0], ROWS) if dims else [])
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
