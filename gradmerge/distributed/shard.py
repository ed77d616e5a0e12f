"""Splitting data over ranks without padding or dropping: contiguous, near-equal parts.

Rank r of R gets items ``[⌊r·n/R⌋, ⌊(r+1)·n/R⌋)`` of n: every item exactly once, in order, so the
ranks' shards concatenated in rank order are the data itself (the single-process run that a
distributed estimate equals). Parts differ in size by at most one item.

Shard the DATASET (``shard_range`` and ``torch.utils.data.Subset``) when loading is expensive: a
``DataLoader`` shard by ``shard`` still loads and skips the batches before its part. Do not use
``DistributedSampler`` for curvature: it pads the shards by repeating examples (``drop_last=False``)
or drops the tail (``drop_last=True``), so some examples are counted twice or not at all (pass
``expected_examples=`` to :func:`~gradmerge.distributed.estimate_curvature` to catch it).

Example:
    >>> from gradmerge.distributed import shard, shard_range
    >>> [list(shard_range(5, rank=r, world_size=2)) for r in range(2)]
    [[0, 1], [2, 3, 4]]
    >>> shard(["b0", "b1", "b2"], rank=1, world_size=2)
    ['b1', 'b2']
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, TypeVar

from gradmerge.errors import ArgumentError

T = TypeVar("T")


def shard_range(
    n: int, *, group: Any = None, rank: int | None = None, world_size: int | None = None
) -> range:
    """The indices ``[⌊r·n/R⌋, ⌊(r+1)·n/R⌋)`` of rank r of R (default: this process in ``group``).

    Raises:
        ArgumentError: negative ``n``, a rank outside ``[0, world_size)``, or no rank/world size
            given while torch.distributed is not initialised.
    """
    rank, world_size = _rank_world(group, rank, world_size)
    if not isinstance(n, int) or n < 0:
        raise ArgumentError(f"n must be a non-negative int (the number of items), got {n!r}")
    return range(rank * n // world_size, (rank + 1) * n // world_size)


def shard(
    data: Iterable[T],
    *,
    group: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> Sequence[T] | Iterable[T]:
    """This rank's contiguous part of ``data`` (batches, examples; see :func:`shard_range`).

    A sequence (list, tuple) is sliced; any other sized iterable (a DataLoader, a re-iterable
    batch container) gives a re-iterable view that skips to its part on each pass.

    Raises:
        ArgumentError: ``data`` without ``len()`` (a generator: materialise it or shard the
            dataset), and the cases of :func:`shard_range`.
    """
    if not hasattr(data, "__len__"):
        raise ArgumentError(
            f"cannot shard a {type(data).__name__} without len(): pass a list of batches or a "
            "DataLoader, or shard the dataset with shard_range"
        )
    part = shard_range(len(data), group=group, rank=rank, world_size=world_size)  # type: ignore[arg-type]
    if isinstance(data, (list, tuple)):
        return data[part.start : part.stop]
    return _Slice(data, part.start, part.stop)


class _Slice(Iterable[T]):
    """Items ``[start, stop)`` of a re-iterable, re-iterable itself."""

    def __init__(self, data: Iterable[T], start: int, stop: int) -> None:
        self.data, self.start, self.stop = data, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[T]:
        return islice(iter(self.data), self.start, self.stop)


def _rank_world(group: Any, rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ArgumentError(
                "torch.distributed is not initialised: pass rank= and world_size=, or call "
                "torch.distributed.init_process_group() first"
            )
        rank = dist.get_rank(group) if rank is None else rank
        world_size = dist.get_world_size(group) if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ArgumentError(f"need 0 ≤ rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size
