"""Fingerprints of a checkpoint's weight VALUES: the exact content hash and the sample hash.

:func:`content_hash` is the provenance fingerprint of a whole checkpoint (``gradmerge_merge.json``
records it for every input): SHA-256 over the sorted names, dtypes and shapes and, per tensor, the
exact stored bytes of the whole tensor when it holds at most :data:`WHOLE` entries, else of
:data:`CONTENT_ROWS` whole rows evenly spaced along the first dimension (first and last
included). No rounding: a change of one bit in a sampled row changes it. It reads at most
CONTENT_ROWS rows per large tensor (e.g. 16 × 768 × 4 B = 48 kB of a GPT-2 embedding), never a
whole large tensor, so two checkpoints that differ only outside the sampled rows of every large
tensor get the same fingerprint; fine-tuning changes (almost) every row, so different fine-tunes
and their base do not.

The sample hash a curvature records of the weights it was estimated at
(:func:`~gradmerge.curvature.provenance.sample_hash_from`, :data:`META_KEY`) lives with the
curvature (:mod:`gradmerge.curvature.provenance`: the estimators, which know no files, record it)
and is re-exported here for the readers of checkpoints that compare it.

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

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from gradmerge.curvature.provenance import META_KEY, evenly, sample_hash_from

__all__ = [
    "CONTENT_HASH_OF",
    "CONTENT_ROWS",
    "META_KEY",
    "WHOLE",
    "content_hash",
    "sample_hash_from",
]

CONTENT_ROWS = 16
"""Rows per large tensor hashed by :func:`content_hash`."""
WHOLE = 65536
"""Tensors with at most this many entries are hashed whole by :func:`content_hash`."""
CONTENT_HASH_OF = (
    f"values: SHA-256 of names, dtypes, shapes and the exact bytes of every tensor of at most "
    f"{WHOLE} entries and of {CONTENT_ROWS} evenly spaced rows of every larger one"
)
"""What :func:`content_hash` covers, as the merge record states it."""


def content_hash(
    keys: Iterable[str],
    shape: Callable[[str], tuple[int, ...]],
    dtype: Callable[[str], torch.dtype],
    rows: Callable[[str, list[int]], Tensor],
) -> str:
    """The provenance fingerprint of a checkpoint (module docstring): SHA-256 of the names,
    dtypes, shapes and exact bytes of every small tensor and of :data:`CONTENT_ROWS` rows of every
    large one, read with ``rows(key, indices)`` (``indices`` empty: the whole tensor)."""
    digest = hashlib.sha256()
    for key in sorted(keys):
        dims = tuple(shape(key))
        kind = str(dtype(key)).removeprefix("torch.")
        digest.update(f"{key}:{kind}:{','.join(map(str, dims))};".encode())
        numel = 1
        for d in dims:
            numel *= d
        whole = not dims or numel <= WHOLE
        value = rows(key, [] if whole else evenly(dims[0], CONTENT_ROWS)).detach().cpu()
        digest.update(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
