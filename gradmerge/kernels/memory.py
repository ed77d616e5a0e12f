"""Fresh output tensors that do not pay a page fault per 4 KiB.

A merge writes every output element once. On Linux a large fresh CPU tensor is new anonymous
memory (glibc serves big blocks by ``mmap``), and its first write faults it in 4 KiB page by
page: on the benchmark machine that made writing a fresh 256 MiB output ~6× slower than writing
memory already touched (``python -m benchmarks.merge``, kernel "addcmul allocating its
output"). :func:`empty` maps large CPU outputs itself and asks for transparent huge pages
(``madvise(MADV_HUGEPAGE)``: 2 MiB per fault where the kernel allows it), which cut that cost
by ~4×. Everywhere else (other devices, small sizes, no ``madvise``) it is ``torch.empty``.

The tensor owns its mapping (``torch.frombuffer`` keeps the ``mmap`` object alive, and the
mapping is released with the tensor's storage); it behaves as any CPU tensor except that its
storage cannot be resized.

A loop that makes, writes and drops outputs one after another (the streaming engine) runs
within :func:`recycling`: there a mapping that no tensor refers to anymore is handed out again
for the next output of the same size, already faulted in, so the faults are paid once per size
instead of once per tensor. Only mappings nothing refers to are reused (CPython's reference
count of the ``mmap`` object, which every tensor on it holds through its buffer), and free
mappings of other sizes are released before a new one is mapped: the memory held never
exceeds what the live outputs plus one size's free mappings take.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import Tensor

HUGE_FROM = 1 << 23
"""Bytes from which :func:`empty` maps a CPU tensor itself (4 huge pages)."""

_pool: ContextVar[list[mmap.mmap] | None] = ContextVar("gradmerge_memory_pool", default=None)


@contextlib.contextmanager
def recycling() -> Iterator[None]:
    """Within the block, :func:`empty` reuses the mappings of outputs no tensor refers to anymore.

    Example:
        >>> import torch
        >>> with recycling():
        ...     a = empty((1 << 22,), like=torch.zeros(1))
        ...     address = a.data_ptr()
        ...     del a                                   # written and dropped
        ...     b = empty((1 << 22,), like=torch.zeros(1))
        >>> b.data_ptr() == address
        True
    """
    token = _pool.set([])
    try:
        yield
    finally:
        _pool.reset(token)  # the mappings go with the tensors still on them


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
    pool = _pool.get()
    if pool is not None:
        reused = _reuse(pool, nbytes)
        if reused is not None:
            return torch.frombuffer(reused, dtype=like.dtype).view(shape)
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # e.g. an address-space limit: the allocator may still find room
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    with contextlib.suppress(OSError):  # THP disabled: ordinary pages, as torch.empty gives
        mapping.madvise(mmap.MADV_HUGEPAGE)
    if pool is not None:
        pool.append(mapping)
    return torch.frombuffer(mapping, dtype=like.dtype).view(shape)


def _reuse(pool: list[mmap.mmap], nbytes: int) -> mmap.mmap | None:
    """A mapping of ``nbytes`` in ``pool`` that no tensor refers to; when there is none, the
    free mappings (of other sizes) leave the pool, which releases them."""
    for i in range(len(pool)):
        if len(pool[i]) == nbytes and sys.getrefcount(pool[i]) == _FREE:
            return pool[i]
    pool[:] = [pool[i] for i in range(len(pool)) if sys.getrefcount(pool[i]) > _FREE]
    return None


_FREE = 2
"""``sys.getrefcount(pool[i])`` of a mapping only the pool holds (the pool, the argument)."""
