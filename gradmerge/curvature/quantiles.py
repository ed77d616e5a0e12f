r"""Exact order statistics of a stream of tensors, in bounded memory (radix selection).

:class:`OrderStatistics` takes the values of a stream one tensor at a time, in as many passes
over the same stream as it asks for, and returns the requested percentiles EXACTLY as
``numpy.percentile`` (linear interpolation, the default method) computes them on the
concatenation of every value, while holding at most a few MiB whatever the stream's length:

1. **Keys.** A float's bit pattern, read as a signed integer of the same width, sorts like the
   float once a negative number's magnitude bits are flipped (and −0.0 is read as +0.0): integer
   order = float order, so selecting by key selects by value.
2. **First pass.** A histogram of the keys' top 20 bits (2²⁰ buckets: sign, exponent and the
   leading mantissa bits, so about 2⁸ buckets per factor of two for float32 and float64 alike),
   with the count, the zeros and the extremes. Its cumulative sum names, for each needed rank,
   the bucket holding it and how many entries lie below.
3. **Further passes.** Each bucket that holds a needed rank is either GATHERED (at most
   :data:`GATHER` entries: its keys are kept, sorted, and the rank read off) or split by the
   next bits of the key into a finer histogram (a bucket that is larger: a dense cluster of
   values, or a tie). A bucket whose entries turn out to be all equal is resolved at once (a
   curvature with 40% exact zeros needs two passes, not five); a prefix of the whole key width is
   a single value. Real curvatures take two passes; every value of one tie, or of a few hundred
   thousand values within a relative 10⁻⁶, at most four (float64) or two (float32).

Memory: the first histogram (8 MiB) and, per needed rank, at most :data:`GATHER` keys or one
2¹⁶-bucket histogram; values are processed in chunks of :data:`CHUNK`, so no temporary grows
with a tensor either. The stream must give the same values in every pass (a change is detected
by the counts and refused).

Why selection rather than ``torch.kthvalue``/``numpy.partition`` per tensor and a merge: a
percentile of the concatenation is not a function of the tensors' own percentiles, so a merge
would need every tensor's values at once (or a sorted copy of each): memory that grows with the
model. Sketches (t-digest, KLL) bound memory but not the error; the two-pass selection bounds both.

Example:
    >>> import numpy as np, torch
    >>> parts = [torch.tensor([3.0, 0.0, -1.0]), torch.tensor([2.5, 7.0])]
    >>> stats = OrderStatistics({"p50": 0.5, "p90": 0.9})
    >>> while stats.wants_pass:
    ...     for t in parts:
    ...         stats.add(t)
    ...     stats.end_pass()
    >>> stats.percentiles == {"p50": 2.5, "p90": float(np.percentile([3, 0, -1, 2.5, 7], 90))}
    True
    >>> stats.count, stats.zeros, stats.negatives, stats.min_positive
    (5, 1, 1, 2.5)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gradmerge.errors import ArgumentError, NonFiniteError

GATHER = 1 << 20
"""Entries of one bucket kept to read a rank off (8 MiB of int64 keys); a larger bucket is split."""
CHUNK = 1 << 20
"""Values handled at once: temporaries stay a few times this (8 MiB in float64), whatever a
tensor's size."""
_FIRST = 20
"""Bits of the key in the first pass's histogram."""
_NEXT = 16
"""Bits added by each further pass's histogram."""

_KEY = {torch.float32: torch.int32, torch.float64: torch.int64}


def sort_keys(values: Tensor) -> Tensor:
    """Integers in the order of ``values`` (float32 → int32, float64 → int64; −0.0 as +0.0).

    Example:
        >>> x = torch.tensor([1.5, -0.0, -2.0, 0.0, -1e-30, 3e38])
        >>> torch.equal(torch.argsort(sort_keys(x), stable=True), torch.argsort(x, stable=True))
        True
    """
    width = _KEY[values.dtype]
    bits = values.view(width)
    if bits.numel() == 0 or bool(
        bits.min() >= 0
    ):  # no sign bit set: the common case, nothing to flip
        return bits
    bits = (values + 0.0).view(width)  # −0.0 + 0.0 = +0.0
    flip = torch.iinfo(width).max
    return torch.where(bits < 0, bits ^ flip, bits)


def value_of(key: int, dtype: torch.dtype) -> float:
    """The float whose :func:`sort_keys` key is ``key``."""
    width = _KEY[dtype]
    if key < 0:
        key ^= torch.iinfo(width).max
    return float(torch.tensor([key], dtype=width).view(dtype)[0])


@dataclass
class _Bucket:
    """A range of keys holding needed ranks: the keys whose top ``length`` bits are ``prefix``."""

    prefix: int
    length: int
    below: int  # entries with smaller keys than the range
    count: int  # entries in the range
    ranks: list[int]
    gather: bool
    keys: list[Tensor] = field(default_factory=list)
    histogram: Tensor | None = None
    low: int | None = None  # the smallest and largest key seen in the range this pass
    high: int | None = None


class OrderStatistics:
    """Exact percentiles of a stream of tensors, over as many passes as needed (module docstring).

    Args:
        quantiles: name → q in [0, 1], over every value (``numpy.percentile(all, 100 q)``).
        positive: name → q in [0, 1], over the values > 0 only (empty when there are none).
        dtype: the values' dtype (float32 or float64); other floating dtypes are cast to it.
            float32 values of float32, bfloat16 and float16 tensors are exact.

    Use: ``while stats.wants_pass: (add every tensor of the stream); stats.end_pass()``.
    Then ``percentiles``, ``positive_percentiles``, ``count``, ``zeros``, ``negatives``,
    ``min_positive``.

    Raises:
        NonFiniteError: a value is NaN or infinite (from :meth:`add`).
        ArgumentError: a q outside [0, 1], another dtype, or a stream that changed between
            passes (from :meth:`end_pass`).
    """

    def __init__(
        self,
        quantiles: Mapping[str, float],
        *,
        positive: Mapping[str, float] | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        if dtype not in _KEY:
            raise ArgumentError(f"order statistics are kept in float32 or float64, not {dtype}")
        for q in [*quantiles.values(), *(positive or {}).values()]:
            if not 0.0 <= q <= 1.0:
                raise ArgumentError(f"a quantile must lie in [0, 1], got {q!r}")
        self.quantiles = dict(quantiles)
        self.positive = dict(positive or {})
        self.dtype = dtype
        self._bits = torch.iinfo(_KEY[dtype]).bits
        self.count = self.zeros = self.negatives = 0
        self.passes = 0
        self.min: float | None = None
        self.max: float | None = None
        self._first: Tensor | None = None  # the first pass's histogram, once past GATHER
        self._gathered: list[Tensor] | None = []  # the first pass's keys, while within GATHER
        self._buckets: list[_Bucket] = []
        self._mask: Tensor | None = None  # first-pass buckets holding a needed rank
        self._known: dict[int, float] = {}  # rank → value
        self.wants_pass = True

    # ----- feeding -------------------------------------------------------------------------
    def add(self, values: Tensor) -> None:
        """Take ``values`` (any shape) as part of the current pass."""
        if not self.wants_pass:
            raise ArgumentError("no pass is under way: the order statistics are complete")
        flat = values.detach().reshape(-1)
        for start in range(0, flat.numel(), CHUNK):
            chunk = flat[start : start + CHUNK].to(device="cpu", dtype=self.dtype)
            if self.passes == 0:
                self._add_first(chunk)
            else:
                self._add_later(sort_keys(chunk))

    def _add_first(self, chunk: Tensor) -> None:
        low, high = (float(x) for x in torch.aminmax(chunk))
        if not (math.isfinite(low) and math.isfinite(high)):
            raise NonFiniteError(
                "a value to summarise is NaN or infinite: the curvature is not finite; estimate "
                "it again (or find the input that overflowed)"
            )
        self._count_first(chunk.numel(), chunk.numel() - int(torch.count_nonzero(chunk)), low, high)
        self._keys_first(sort_keys(chunk))

    def _count_first(self, count: int, zeros: int, low: float | None, high: float | None) -> None:
        self.count += count
        self.zeros += zeros
        if low is not None and high is not None:
            self.min = low if self.min is None else min(self.min, low)
            self.max = high if self.max is None else max(self.max, high)

    def _keys_first(self, keys: Tensor) -> None:
        """The first pass keeps the keys themselves while they are few (one pass suffices then),
        else their top bits' histogram."""
        if self._gathered is not None:
            self._gathered.append(keys.clone())
            if sum(k.numel() for k in self._gathered) <= GATHER:
                return
            gathered, self._gathered = self._gathered, None
            for k in gathered:
                self._keys_first(k)
            return
        top = (keys >> (self._bits - _FIRST)) + (1 << (_FIRST - 1))
        counts = torch.bincount(top, minlength=1 << _FIRST)
        self._first = counts if self._first is None else self._first.add_(counts)

    def absorb(self, other: OrderStatistics) -> None:
        """Count ``other``'s first pass as part of this one's (``other``: the same dtype, its
        first pass fed and not yet ended): a file's first pass from its layers', each value
        keyed once."""
        if other.dtype != self.dtype or other.passes or self.passes:
            raise ArgumentError("absorb takes the open first pass of statistics of one dtype")
        self._count_first(other.count, other.zeros, other.min, other.max)
        if other._gathered is not None:
            for k in other._gathered:
                self._keys_first(k)
        elif other._first is not None:
            if self._gathered is not None:
                gathered, self._gathered = self._gathered, None
                self._first = other._first.clone()
                for k in gathered:
                    self._keys_first(k)
            else:  # a copy: other's own histogram goes on to its later passes
                self._first = (
                    other._first.clone() if self._first is None else self._first.add_(other._first)
                )

    def _add_later(self, keys: Tensor) -> None:
        assert self._mask is not None
        top = (keys >> (self._bits - _FIRST)) + (1 << (_FIRST - 1))
        candidates = keys[self._mask[top]]
        if candidates.numel() == 0:
            return
        for b in self._buckets:
            inside = candidates[(candidates >> (self._bits - b.length)) == b.prefix]
            if inside.numel() == 0:
                continue
            if b.gather:
                b.keys.append(inside.clone())
                continue
            low, high = (int(x) for x in torch.aminmax(inside))
            b.low = low if b.low is None else min(b.low, low)
            b.high = high if b.high is None else max(b.high, high)
            width = min(_NEXT, self._bits - b.length)
            sub = (inside >> (self._bits - b.length - width)) & ((1 << width) - 1)
            counts = torch.bincount(sub, minlength=1 << width)
            b.histogram = counts if b.histogram is None else b.histogram + counts

    # ----- between passes ------------------------------------------------------------------
    def end_pass(self) -> None:
        """Close the current pass; ``wants_pass`` says whether another one is needed."""
        self.passes += 1
        if self.passes == 1:
            self._end_first()
        else:
            self._end_later()
        self.wants_pass = bool(self._buckets)
        if self.wants_pass:
            mask = torch.zeros(1 << _FIRST, dtype=torch.bool)
            for b in self._buckets:
                mask[(b.prefix >> (b.length - _FIRST)) + (1 << (_FIRST - 1))] = True
            self._mask = mask

    def _ranks(self) -> set[int]:
        needed: set[int] = set()
        for q in self.quantiles.values():
            needed.update(_neighbours(self.count, q))
        positives = self.count - self.negatives - self.zeros
        if positives:
            needed.add(self.count - positives)  # the smallest positive value
            for q in self.positive.values():
                needed.update(self.count - positives + r for r in _neighbours(positives, q))
        return needed

    def _end_first(self) -> None:
        gathered, self._gathered = self._gathered, None
        histogram, self._first = self._first, None
        if self.count == 0:
            return
        if gathered is not None:  # every key is at hand: read the ranks off them
            keys = torch.sort(torch.cat(gathered)).values if gathered else torch.empty(0)
            self.negatives = int((keys < 0).sum())
            self._known = {r: value_of(int(keys[r]), self.dtype) for r in self._ranks()}
            return
        assert histogram is not None and self.min is not None and self.max is not None
        self.negatives = int(histogram[: 1 << (_FIRST - 1)].sum())
        ranks = self._ranks()
        self._known = {r: v for r, v in ((0, self.min), (self.count - 1, self.max)) if r in ranks}
        pending = sorted(ranks - set(self._known))
        self._split(pending, histogram, prefix=-1, length=0, below=0)

    def _split(
        self, ranks: list[int], histogram: Tensor, prefix: int, length: int, below: int
    ) -> None:
        """New buckets for ``ranks`` from the ``histogram`` of the range (``prefix``, ``length``)
        (``length`` 0: the first pass, whose buckets are signed)."""
        if not ranks:
            return
        ends = torch.cumsum(histogram, 0)
        width = _FIRST if length == 0 else min(_NEXT, self._bits - length)
        places = torch.searchsorted(ends, torch.tensor(ranks) - below, right=True).tolist()
        by_bucket: dict[int, list[int]] = {}
        for rank, j in zip(ranks, places, strict=True):
            by_bucket.setdefault(j, []).append(rank)
        for j, rs in by_bucket.items():
            start = below + (int(ends[j - 1]) if j > 0 else 0)
            count = int(histogram[j])
            new = j - (1 << (_FIRST - 1)) if length == 0 else (prefix << width) | j
            new_length = length + width
            if new_length == self._bits:  # the whole key: one value
                self._known.update({r: value_of(new, self.dtype) for r in rs})
                continue
            self._buckets.append(_Bucket(new, new_length, start, count, rs, count <= GATHER))

    def _end_later(self) -> None:
        buckets, self._buckets = self._buckets, []
        for b in buckets:
            if b.gather:
                keys = torch.sort(torch.cat(b.keys)).values if b.keys else torch.empty(0)
                self._check(b, keys.numel())
                self._known.update(
                    {r: value_of(int(keys[r - b.below]), self.dtype) for r in b.ranks}
                )
                continue
            histogram = b.histogram if b.histogram is not None else torch.zeros(1)
            self._check(b, int(histogram.sum()))
            if b.low == b.high:  # every entry of the range is one value
                assert b.low is not None
                self._known.update({r: value_of(b.low, self.dtype) for r in b.ranks})
                continue
            self._split(b.ranks, histogram, b.prefix, b.length, b.below)

    def _check(self, bucket: _Bucket, seen: int) -> None:
        if seen != bucket.count:
            raise ArgumentError(
                f"the values changed between passes ({seen} entries in a range that held "
                f"{bucket.count}): the order statistics need the same stream in every pass; "
                "was a file rewritten while it was read?"
            )

    # ----- results ---------------------------------------------------------------------------
    def _require(self) -> None:
        if self.wants_pass:
            raise ArgumentError("the order statistics need another pass over the values first")

    @property
    def percentiles(self) -> dict[str, float]:
        """name → percentile over every value (``numpy.percentile``'s linear method); empty
        when no value came."""
        self._require()
        return {
            k: self._quantile(q, 0, self.count) for k, q in self.quantiles.items() if self.count
        }

    @property
    def positive_percentiles(self) -> dict[str, float]:
        """name → percentile over the positive values; empty when none is positive."""
        self._require()
        positives = self.count - self.negatives - self.zeros
        offset = self.count - positives
        return {
            k: self._quantile(q, offset, positives) for k, q in self.positive.items() if positives
        }

    @property
    def min_positive(self) -> float | None:
        """The smallest positive value (None: none is positive)."""
        self._require()
        positives = self.count - self.negatives - self.zeros
        return self._known[self.count - positives] if positives else None

    def _quantile(self, q: float, offset: int, n: int) -> float:
        """numpy.percentile's linear interpolation between the order statistics around
        (n − 1)·q, among the n values from rank ``offset``, with numpy's own arithmetic."""
        low, high = _neighbours(n, q)
        a, b = self._known[offset + low], self._known[offset + high]
        if low == high:
            return a
        t = (n - 1) * q - low
        diff = b - a
        return b - diff * (1 - t) if t >= 0.5 else a + diff * t


def _neighbours(n: int, q: float) -> tuple[int, int]:
    """The ranks numpy interpolates between for quantile q of n values (the last one twice
    at or past the end)."""
    virtual = (n - 1) * q
    if virtual >= n - 1:
        return n - 1, n - 1
    low = math.floor(virtual)
    return low, low + 1


def order_statistics(
    tensors: Iterable[Tensor],
    quantiles: Mapping[str, float],
    *,
    positive: Mapping[str, float] | None = None,
    dtype: torch.dtype = torch.float64,
) -> OrderStatistics:
    """:class:`OrderStatistics` of tensors already in memory (every pass over the same list).

    Example:
        >>> order_statistics([torch.arange(5.0)], {"p25": 0.25}).percentiles
        {'p25': 1.0}
    """
    parts = list(tensors)
    stats = OrderStatistics(quantiles, positive=positive, dtype=dtype)
    for t in parts:
        stats.add(t)
    return finish(stats, parts)


def finish(stats: OrderStatistics, tensors: Iterable[Tensor]) -> OrderStatistics:
    """End the pass under way of ``stats`` and take as many more over ``tensors`` (in memory,
    the values that pass was fed) as it needs; ``stats`` itself, complete."""
    parts = list(tensors)
    stats.end_pass()
    while stats.wants_pass:
        for t in parts:
            stats.add(t)
        stats.end_pass()
    return stats
