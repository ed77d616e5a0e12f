"""Sums of Gram matrices Σ rowsᵀ rows, accumulated on and above the diagonal: K-FAC's factors.

Every factor of :mod:`gradmerge.estimate.kfac` is such a sum over the calls of its layer. The
products go in row blocks from the diagonal rightwards (:func:`add_gram`: the blocks below the
diagonal are never computed, :func:`symmetrize_` mirrors them once at the end), and the rows of
small calls are gathered into products of at least :data:`GRAM_ROWS` rows (:class:`GramSum`,
within an estimate's :class:`Budget` of buffer memory).

Example:
    >>> import torch
    >>> from gradmerge.estimate._gram import add_gram, symmetrize_
    >>> rows = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> acc = torch.zeros(2, 2)
    >>> add_gram(acc, rows)
    >>> torch.equal(symmetrize_(acc), rows.T @ rows)
    True
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

# Gram matrices (``add_gram``) from this side on skip their blocks below the diagonal: below,
# several smaller products are no faster than one.
GRAM_BLOCKS_FROM = 512
# Row blocks of such Gram matrices: at least this many columns wide (a multiple of 64 columns,
# so that every block starts on a 256-byte boundary for the GEMM kernels), at most this many.
_GRAM_BLOCK_WIDTH, _GRAM_MAX_BLOCKS = 128, 8
# Gram products take at least this many rows at a time: the rows of smaller calls (small batches;
# ``"reduce"``, one row per example) are gathered first (``GramSum``). For an MLP's factors
# (sides 512-785) one product over 1024 rows cost 5-8% less per row than four over 256, and the
# whole estimate (batches of 256) ran ~6% faster; with "reduce" on a GPT-2 config, ~12%.
GRAM_ROWS = 1024
# The most memory, per estimate, that the gathered rows may take (buffers of GRAM_ROWS rows,
# one per factor, while they fit: 64 MiB holds 16k float32 columns of buffers, e.g. every factor
# of a 4-layer MLP of width 2048; the others take their calls' products one by one).
GRAM_BUFFER_BYTES = 64 * 2**20


def add_gram(acc: Tensor, rows: Tensor, alpha: float = 1.0) -> None:
    """``acc[:n, :n] += alpha · rowsᵀ rows`` (n = rows.shape[1]) ON AND ABOVE THE DIAGONAL only.

    Large sides go in row blocks ``[lo, hi)``, each from its diagonal block rightwards
    (``acc[lo:hi, lo:] += rows[:, lo:hi]ᵀ rows[:, lo:]``, one GEMM per block): with k blocks the
    products cost (k + 1)/(2k) of the full one (k = 6 for a side of 784: 58%). The blocks below
    the diagonal are never computed; ``symmetrize_`` fills them at the end.
    """
    n = rows.shape[1]
    if n == acc.shape[0] and n < GRAM_BLOCKS_FROM:  # one product, no views (the common G)
        acc.addmm_(rows.T, rows, alpha=alpha)
        return
    for lo, hi in gram_blocks(n):
        acc[lo:hi, lo:n].addmm_(rows[:, lo:hi].T, rows[:, lo:], alpha=alpha)


@functools.cache
def gram_blocks(n: int) -> tuple[tuple[int, int], ...]:
    """Row blocks of a Gram matrix of side n: one block below ``GRAM_BLOCKS_FROM``, else
    64-aligned blocks of ``_GRAM_BLOCK_WIDTH`` columns or more (at most ``_GRAM_MAX_BLOCKS``; the
    last block takes the remainder)."""
    if n < GRAM_BLOCKS_FROM:
        return ((0, n),)
    width = max(_GRAM_BLOCK_WIDTH, -(-n // _GRAM_MAX_BLOCKS))
    width = -(-width // 64) * 64
    starts = list(range(0, n - width // 2, width))
    return tuple(zip(starts, [*starts[1:], n], strict=True))


@dataclass
class Budget:
    """Bytes left for ``GramSum`` buffers in one estimate."""

    left: int


@dataclass
class GramSum:
    """``acc[:n, :n] += Σ_calls alpha · rowsᵀ rows`` (upper triangle, ``add_gram``), with the rows
    of calls smaller than ``GRAM_ROWS`` gathered into one product.

    Rows wait in a buffer of ``GRAM_ROWS`` rows (allocated at the first small call while the
    estimate's ``Budget`` allows; otherwise every call is its own product) until it is full, a
    call with another ``alpha`` comes, or ``flush()`` (``_kfac_layers.finished_factors``). The
    rows are copied in, so later in-place changes to the layer's inputs or gradients cannot
    reach them.
    """

    acc: Tensor
    budget: Budget
    buffer: Tensor | None = None
    filled: int = 0
    alpha: float = 1.0

    def add(self, rows: Tensor, alpha: float = 1.0) -> None:
        k = rows.shape[0]
        if self.filled and (alpha != self.alpha or self.filled + k > GRAM_ROWS):
            self.flush()
        if k >= GRAM_ROWS or not self._has_buffer(rows):
            add_gram(self.acc, rows, alpha)
            return
        assert self.buffer is not None  # _has_buffer
        self.buffer[self.filled : self.filled + k].copy_(rows)
        self.filled, self.alpha = self.filled + k, alpha
        if self.filled == GRAM_ROWS:
            self.flush()

    def flush(self) -> None:
        """Add the gathered rows' product to ``acc``."""
        if self.filled:
            assert self.buffer is not None  # filled > 0 only after add() copied rows in
            add_gram(self.acc, self.buffer[: self.filled], self.alpha)
            self.filled = 0

    def _has_buffer(self, rows: Tensor) -> bool:
        if self.buffer is None:
            size = GRAM_ROWS * rows.shape[1] * rows.element_size()
            if size > self.budget.left:
                return False
            self.budget.left -= size
            self.buffer = rows.new_empty(GRAM_ROWS, rows.shape[1])
        return True


def add_augmented_gram(gram: GramSum, rows: Tensor, bias: bool) -> None:
    """``gram.add`` of ``[rows | 1]`` (the ones column only with ``bias``), except its corner.

    The ones column is not materialised: its entries above the diagonal are the column sums of
    ``rows``, which are those of the rows with a 1 there since the other rows are zero
    (``_kfac_layers.add_inputs``). The corner entry, the number of rows with a 1, is the layer's
    count M: ``_kfac_layers.finished_factors`` writes it once.
    """
    gram.add(rows)
    if bias:
        n = rows.shape[1]
        gram.acc[:n, n].add_(rows.sum(dim=0))  # (``acc[:n, n] += ...`` would copy it back)


def symmetrize_(upper: Tensor, block: int = 128) -> Tensor:
    """In place: the symmetric matrix whose upper triangle (diagonal included) is ``upper``'s.

    Panel by panel of ``block`` columns: the panel below a diagonal block is the transpose of the
    panel to its right, and the diagonal block becomes ``triu(D) + triu(D, 1)ᵀ``. No temporary
    larger than one diagonal block: a fresh matrix-sized one costs page faults that outweigh
    the copy itself (figures in ``benchmarks/README.md``).
    """
    n = upper.shape[0]
    for lo in range(0, n, block):
        hi = min(lo + block, n)
        diagonal = upper[lo:hi, lo:hi]
        diagonal.copy_(torch.triu(diagonal) + torch.triu(diagonal, 1).mT)
        if hi < n:
            upper[hi:, lo:hi].copy_(upper[lo:hi, hi:].mT)
    return upper
