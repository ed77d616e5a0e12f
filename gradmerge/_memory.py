"""Fresh output tensors that do not pay a page fault per 4 KiB.

A merge writes every output element once. On Linux a large fresh CPU tensor is new anonymous
memory (glibc serves big blocks by ``mmap``), and its first write faults it in 4 KiB page by
page: on the benchmark machine that made writing a fresh 256 MiB output ~6× slower than writing
memory already touched (``python benchmarks/merge.py``, kernel "addcmul allocating its
output"). :func:`empty` maps large CPU outputs itself and asks for transparent huge pages
(``madvise(MADV_HUGEPAGE)``: 2 MiB per fault where the kernel allows it), which cut that cost
by ~4×. Everywhere else (other devices, small sizes, no ``madvise``) it is ``torch.empty``.

The tensor owns its mapping (``torch.frombuffer`` keeps the ``mmap`` object alive, and the
mapping is released with the tensor's storage); it behaves as any CPU tensor except that its
storage cannot be resized.
"""

from __future__ import annotations

import contextlib
import mmap

import torch
from torch import Tensor

HUGE_FROM = 1 << 23
"""Bytes from which :func:`empty` maps a CPU tensor itself (4 huge pages)."""


def empty(shape: tuple[int, ...] | torch.Size, *, like: Tensor) -> Tensor:
    """An uninitialised tensor of ``shape`` with ``like``'s dtype and device.

    Example:
        >>> import torch
        >>> t = empty((1024, 4096), like=torch.zeros(1))
        >>> t.fill_(1.0).sum().item(), t.dtype, t.is_contiguous()
        (4194304.0, torch.float32, True)
    """
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * like.element_size()
    if like.device.type != "cpu" or nbytes < HUGE_FROM or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # e.g. an address-space limit: the allocator may still find room
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    with contextlib.suppress(OSError):  # THP disabled: ordinary pages, as torch.empty gives
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=like.dtype).view(shape)
