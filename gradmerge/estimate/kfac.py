r"""K-FAC Kronecker factors of the Fisher/GGN, per layer, as a SUM over examples.

For a layer with weight W (viewed as ``(out, in)``, see *Layout*) K-FAC approximates the curvature
block of its parameters by ``A ⊗ G``, the operator ``V ↦ G V A`` on ``V = [W | b]`` (the bias, if
any, is the LAST input column, and the inputs are augmented with a 1). The factors are normalised
so that ``A ⊗ G`` approximates the SUM over examples Σ_i of the per-example curvature (docs/architecture.md):

    A = (1/M) Σ_{(i,s) kept} a_is a_isᵀ            (a mean over the M kept positions)
    G = Σ_{(i,s) kept} g_is g_isᵀ                   (a sum)

where a_is is the layer input of example i at position s (with a trailing 1 for the bias) and
g_is = ∂ℓ_i/∂z_is the gradient of the example's loss (``gradmerge.estimate._data``: ℓ_i sums its
positions) with respect to the layer's output there. For one example and one position this is
exactly the per-example block ``g gᵀ ⊗ a aᵀ``; for a network without weight sharing M = N.

Weight sharing (Eschenhagen et al., 2023). A layer applied at S positions (tokens; conv patches)
has ∇_W ℓ_i = Σ_s g_is a_isᵀ. Two approximations:

- ``"expand"`` (every position is an example for the factors): the formulas above, M = number of
  kept (example, position) pairs. Exact for deep linear networks whose layers act position-wise
  (type-2, MSE): the GGN block is BᵀB ⊗ Σ a aᵀ with B the Jacobian of the output in z.
- ``"reduce"`` (positions are aggregated first): ā_i = mean_{s kept} a_is, ḡ_i = Σ_{s kept} g_is,
  A = (1/N') Σ_i ā_i ā_iᵀ, G = Σ_i ḡ_i ḡ_iᵀ, N' = number of examples with a kept position. Exact
  for deep linear networks that mean-pool over positions after the layer (type-2, MSE).
  With one position per example the two coincide.

Kept positions. A position takes part in NEITHER factor when its cross-entropy target is
``ignore_index`` or, for dict inputs with an ``attention_mask``, when the mask is 0 there. The
target mask applies to layers whose positions have the targets' shape (otherwise: to whole
examples, all of whose targets are ignored); the attention mask to layers whose positions have its
shape. Caveat: in a causal language model a prompt token whose target is ignored still influences
later tokens, so at inner layers its (nonzero) g_is is dropped too; the estimate is then the
K-FAC of the curvature restricted to the kept positions.

Fisher types (what g is):

- ``"empirical"``: g from the observed targets; one forward and one backward pass per batch.
- ``"mc"``: targets drawn from the model (``_data.sample_targets``), ``mc_samples`` per example,
  G averaged over the samples (G = (1/k) Σ_samples Σ g gᵀ); one forward pass, the backward of
  k vectors.
- ``"ggn"`` (type-2): the output Hessian Λ = S Sᵀ (``_output_hessian``; CE: S = diag(√p) −
  p√pᵀ; MSE: S = I) and the columns of S are backpropagated, G = Σ_c Σ g^(c) g^(c)ᵀ; the
  backward of one vector per class. As in curvlinops, column c is backpropagated from all output
  positions at once, so with weight sharing the cross-position terms (s ≠ s') of outputs that
  mix positions are included.

Several vectors (samples, columns) share ONE vmapped backward pass (``_batched``): a layer's R
output gradients (R, B, ..., out) are R·B rows of a single Gram product for G.

Layout. ``KFACFactors.dense(m)`` is ``kron(G, A)``: the block over ``vec([W | b])`` flattened
row-major, i.e. (W[0, :], b[0], W[1, :], b[1], ...). W is the weight viewed as (out, in):

- ``nn.Linear``: ``weight`` (out, in); ``nn.Conv2d``: ``weight.reshape(out, in·kh·kw)``, the
  inputs being the unfolded patches (``F.unfold``; groups=1 and zero padding only);
- transformers' GPT-2 ``Conv1D`` (y = x W + b, ``weight`` of shape (in, out)) and ``nn.Embedding``
  (``weight`` of shape (vocab, dim), i.e. (in, out) with one-hot inputs): W = ``weight.T``;
  ``KFACFactors.transposed[m]`` is True and the operator on the stored weight is V ↦ A V G.
- ``nn.Embedding``: A = (1/M) diag(token counts) is stored as a 1-D vector (``A.ndim == 1``
  means diag(A)); the ``padding_idx`` row gets count 0 (its gradient is always 0). Embeddings
  always use ``"expand"`` (a reduced A would be a dense vocab × vocab matrix).

Not covered (listed in ``KFACFactors.uncovered``, by ``named_parameters`` name, for a diagonal or
other block): parameters of other module types (LayerNorm, ...), a weight shared by several
modules (tied embeddings and output layer), layers with a factor side above ``kfac_max_factor_side``
(e.g. an untied 32k-vocabulary output layer; see *Factor size*), layers called with a batch
dimension other than the batch's (e.g. position embeddings broadcast over the batch; with one
example per batch they are covered, and exact), modules whose forward is never called
(nn.MultiheadAttention.out_proj, whose weight is used functionally) and modules with a frozen
weight. ``KFACFactors.left_out`` names every supported module with a trainable weight that got
no factors, with the reason; those left out for their size or while running are also named in
a warning (one for the size limit, however many layers it concerns).

Factor size. A layer with weight (out, in) holds a dense A of side in (+1 with a bias) and a
dense G of side out: side² entries each, 4 bytes apiece in float32. An untied language-model
head ``nn.Linear(hidden, vocab)`` has G of side vocab: 4 GB at a 32k vocabulary, 92 GB at 152k,
accumulated (and later decomposed for a merge, O(side³)) per estimate. Layers with a side above
``kfac_max_factor_side`` (default :data:`MAX_FACTOR_SIDE`) are therefore not given factors at all —
nothing of that size is allocated — and their parameters are left to the diagonal block
(``gm.estimate_curvature``). Embeddings store A as a vector (their diagonal), so only their G
side counts here.

Factors are accumulated in float32 (float64 for float64 models) on the parameters' device. The
model is used as given: call ``model.eval()`` first to switch off dropout. Cost: the backward
passes ask autograd for the layers' output gradients only (no weight gradients), and the sums
of outer products are accumulated on and above the diagonal, mirrored once at the end, in
products of at least 1024 rows: the rows of smaller calls (small batches, ``"reduce"``) are
copied into a buffer per factor first (at most 64 MiB of buffers per estimate).

References:
    Martens & Grosse (2015), "Optimizing neural networks with Kronecker-factored approximate
    curvature". Eschenhagen, Immer, Turner, Schneider & Hennig (2023), "Kronecker-Factored
    Approximate Curvature for Modern Neural Network Architectures".

Example:
    >>> import torch
    >>> from gradmerge.estimate.kfac import estimate_kfac_factors
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> data = [(torch.randn(8, 3), torch.randint(0, 2, (8,)))]
    >>> kf = estimate_kfac_factors(model, data, fisher="empirical")
    >>> A, G = kf.factors["0"]
    >>> tuple(A.shape), tuple(G.shape), kf.has_bias["0"], kf.num_examples
    ((4, 4), (4, 4), True, 8)
    >>> tuple(kf.dense("2").shape)  # over vec([W | b]) of the (2, 4) layer: 2 · (4 + 1)
    (10, 10)
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from gradmerge.errors import ArgumentError, NonFiniteError, StructureError
from gradmerge.estimate._batched import Backward, group_size, groups
from gradmerge.estimate._data import (
    Inputs,
    Loss,
    accumulation_dtype,
    batches,
    forward,
    loss_gradient,
    num_examples,
    per_example_loss,
    sample_targets,
)
from gradmerge.estimate._output_hessian import OutputHessian
from gradmerge.estimate.diagonal import SharedPassDiagonal
from gradmerge.estimate.options import (
    MAX_FACTOR_SIDE,
    Fisher,
    FisherName,
    KFACApprox,
    KFACApproxName,
    LossFunction,
    LossName,
    check_fisher,
    check_kfac_max_factor_side,
    check_mc_samples,
)

_FIRST_NAME_UNSET: Any = object()  # max_factor_side= not given (None means "no limit")

LayerKind = Literal["linear", "conv2d", "conv1d", "embedding"]

# Gram matrices (``_add_gram``) from this side on skip their blocks below the diagonal: below,
# several smaller products are no faster than one.
_GRAM_BLOCKS_FROM = 512
# Row blocks of such Gram matrices: at least this many columns wide (a multiple of 64 columns,
# so that every block starts on a 256-byte boundary for the GEMM kernels), at most this many.
_GRAM_BLOCK_WIDTH, _GRAM_MAX_BLOCKS = 128, 8
# Gram products take at least this many rows at a time: the rows of smaller calls (small batches;
# ``"reduce"``, one row per example) are gathered first (``_GramSum``). For an MLP's factors
# (sides 512-785) one product over 1024 rows cost 5-8% less per row than four over 256, and the
# whole estimate (batches of 256) ran ~6% faster; with "reduce" on a GPT-2 config, ~12%.
_GRAM_ROWS = 1024
# The most memory, per estimate, that the gathered rows may take (buffers of _GRAM_ROWS rows,
# one per factor, while they fit: 64 MiB holds 16k float32 columns of buffers, e.g. every factor
# of a 4-layer MLP of width 2048; the others take their calls' products one by one).
_GRAM_BUFFER_BYTES = 64 * 2**20

SUPPORTED_LAYERS = (
    "nn.Linear, nn.Conv2d (groups=1, zero padding), nn.Embedding, transformers Conv1D"
)


@dataclass(frozen=True)
class KFACFactors:
    """K-FAC factors per module; ``A ⊗ G`` approximates a SUM over examples (module docstring).

    Attributes:
        factors: module name → (A, G); A is (in+1, in+1) with a bias, (in, in) without, 1-D for
            embeddings (its diagonal); G is (out, out).
        has_bias: module name → whether the last input column of A is the bias.
        transposed: module name → whether the stored weight is (in, out) (Conv1D, Embedding).
        counts: module name → M, the number of kept positions (expand) or examples (reduce)
            that A was divided by; needed to combine two estimates.
        num_examples: N, examples (batch rows) seen.
        fisher, kfac_approx, loss: the options used.
        uncovered: trainable parameters (``named_parameters`` names) covered by no factor.
        left_out: supported module (``named_modules`` name) with a trainable weight → why it
            has no factors (a factor side above ``kfac_max_factor_side``, a shared weight, never
            called, ...); its parameters are among ``uncovered``.
        kfac_max_factor_side: the factor-side limit used (None: no limit).
        diagonal: parameter name → its diagonal Fisher, collected in the same pass
            (``estimate_kfac_factors(diagonal=True)``), for parameters that may have no factors.
    """

    factors: dict[str, tuple[Tensor, Tensor]]
    has_bias: dict[str, bool]
    transposed: dict[str, bool]
    counts: dict[str, int]
    num_examples: int
    fisher: str
    kfac_approx: str
    loss: str
    uncovered: list[str] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)
    kfac_max_factor_side: int | None = MAX_FACTOR_SIDE
    diagonal: dict[str, Tensor] = field(default_factory=dict)

    @property
    def max_factor_side(self) -> int | None:
        """``kfac_max_factor_side`` under its first name (an alias, still read)."""
        return self.kfac_max_factor_side

    def dense(self, name: str) -> Tensor:
        """``kron(G, A)``: the dense block of module ``name`` over row-major ``vec([W | b])``."""
        a, g = self.factors[name]
        return torch.kron(g, torch.diag(a) if a.ndim == 1 else a)


@dataclass
class _Layer:
    """One covered module and the running sums of its factors."""

    module: nn.Module
    weight: Tensor
    kind: LayerKind
    bias: bool
    a_sum: Tensor  # (in + bias)² running sum, upper triangle; (vocab,) counts for embeddings
    a_gram: _GramSum | None  # the products into a_sum (None for embeddings)
    g_gram: _GramSum  # its ``acc`` is the (out, out) running sum of G, upper triangle
    count: int = 0
    calls: int = 0


def _kind(module: nn.Module) -> LayerKind | None:
    """The K-FAC layer kind of ``module``, or None when it is not supported."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.Conv2d):
        ok = module.groups == 1 and module.padding_mode == "zeros"
        ok = ok and not isinstance(module.padding, str)
        return "conv2d" if ok else None
    cls = type(module)
    if cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers"):
        return "conv1d"
    return None


def _weight(module: nn.Module) -> Tensor:
    weight = module.weight
    assert isinstance(weight, Tensor)
    return weight


def _sides(weight: Tensor, kind: LayerKind) -> tuple[int, int]:
    """(in, out) of the (out, in) view of the weight."""
    if kind in ("conv1d", "embedding"):
        return int(weight.shape[0]), int(weight.shape[1])
    return int(weight[0].numel()), int(weight.shape[0])


def _too_large(sides: dict[str, int], limit: int | None) -> str:
    """Why factors of these sides (``{"G": out, "A": in + bias}``) are above the side limit, or
    "" when they are not."""
    over = [f"{f} would be {n} × {n}" for f, n in sides.items() if limit is not None and n > limit]
    return f"{' and '.join(over)}: a factor side above the limit of {limit}" if over else ""


def _largest_factor(name: str, sides: dict[str, int], dtype: torch.dtype) -> str:
    """``'name' (G: n × n, 3.8 GiB in float32)``: a layer's largest factor and its memory."""
    factor, side = max(sides.items(), key=lambda fs: fs[1])
    size = side**2 * torch.finfo(dtype).bits // 8
    unit, scale = ("GiB", 2**30) if size >= 2**30 else ("MiB", 2**20)
    return f"{name!r} ({factor}: {side} × {side}, {size / scale:.1f} {unit} in {dtype})".replace(
        "torch.", ""
    )


def _select_layers(
    model: nn.Module,
    modules: Sequence[str] | None,
    kfac_max_factor_side: int | None,
    left_out: dict[str, str],
) -> dict[str, _Layer]:
    """The covered modules: supported, trainable, not sharing their weight, small enough.

    Supported modules with a trainable weight that are not covered go to ``left_out`` with the
    reason; those left out for their size are named in one warning.
    """
    named = dict(model.named_modules())
    if modules is not None:
        missing = [m for m in modules if m not in named]
        if missing:
            raise ArgumentError(
                f"modules {missing} are not in the model; pass names from model.named_modules()"
            )
        unsupported = [f"{m} ({type(named[m]).__name__})" for m in modules if not _kind(named[m])]
        if unsupported:
            raise ArgumentError(
                f"modules {unsupported} are not K-FAC layers; supported: {SUPPORTED_LAYERS}"
            )
    candidates = {n: m for n, m in named.items() if _kind(m) and (modules is None or n in modules)}
    if not candidates:
        raise StructureError(f"the model has no K-FAC layer: looked for {SUPPORTED_LAYERS}")
    weight_users: dict[int, list[str]] = {}
    for n, m in named.items():
        if isinstance(getattr(m, "weight", None), Tensor):
            weight_users.setdefault(id(m.weight), []).append(n)
    layers, too_large, budget = {}, [], _Budget(_GRAM_BUFFER_BYTES)
    for name, module in candidates.items():
        weight = _weight(module)
        if not weight.requires_grad:
            continue
        others = [n for n in weight_users[id(weight)] if n != name]
        if others:
            left_out[name] = f"its weight is shared with {others} (tied)"
            continue
        kind = _kind(module)
        assert kind is not None
        n_in, n_out = _sides(weight, kind)
        bias = getattr(module, "bias", None)
        has_bias = isinstance(bias, Tensor) and bias.requires_grad
        a_side = n_in + has_bias
        device, dtype = weight.device, accumulation_dtype(weight)
        sides = {"G": n_out} if kind == "embedding" else {"G": n_out, "A": a_side}  # A: a vector
        reason = _too_large(sides, kfac_max_factor_side)
        if reason:
            left_out[name] = reason
            too_large.append(_largest_factor(name, sides, dtype))
            continue
        a_shape = (n_in,) if kind == "embedding" else (a_side, a_side)
        a_sum = torch.zeros(a_shape, device=device, dtype=dtype)
        layers[name] = _Layer(
            module,
            weight,
            kind,
            has_bias,
            a_sum,
            None if kind == "embedding" else _GramSum(a_sum, budget),
            _GramSum(torch.zeros(n_out, n_out, device=device, dtype=dtype), budget),
        )
    if too_large:
        warnings.warn(
            f"K-FAC gives no Kronecker factors to {', '.join(too_large)}: a factor side above "
            f"the limit of {kfac_max_factor_side}; gm.estimate_curvature covers their parameters "
            "with a diagonal block. To keep them on K-FAC, raise the limit "
            "(gm.estimate_curvature's kfac_max_factor_side; None for no limit).",
            stacklevel=3,
        )
    return layers


@dataclass(frozen=True)
class _Masks:
    """Which positions of a batch are kept (module docstring), by the shape of a layer's positions."""

    targets: Tensor  # (B, *T) bool, or (B,) for losses without positions
    attention: Tensor | None  # (B, S) bool
    everything: bool  # every example has positions and all are kept: no layer needs a mask

    @classmethod
    def of_batch(cls, inputs: Inputs, targets: Tensor, loss: Loss) -> _Masks:
        if loss.name == "cross_entropy" and not targets.is_floating_point():
            keep = targets != loss.ignore_index
        else:
            keep = torch.ones(num_examples(targets), dtype=torch.bool, device=targets.device)
        attention = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
        attention = None if attention is None else attention.bool()
        everything = keep.numel() > 0 and bool(keep.all())
        everything = everything and (attention is None or bool(attention.all()))
        return cls(keep, attention, everything)

    def keep(self, positions: torch.Size, device: torch.device) -> Tensor | None:
        """(B, P) bool for a layer applied at positions of shape ``positions`` (P = their numel);
        None when every position is kept."""
        if self.everything:
            return None
        batch = self.targets.shape[0]
        if self.targets.shape[1:] == positions:
            keep = self.targets.reshape(batch, -1)
        else:
            keep = self.targets.reshape(batch, -1).any(dim=1, keepdim=True)
            keep = keep.expand(batch, positions.numel())
        if self.attention is not None and self.attention.shape[1:] == positions:
            keep = keep & self.attention.reshape(batch, -1)
        return keep.to(device)


def _layer_inputs(layer: _Layer, x: Tensor, out: Tensor) -> tuple[torch.Size, Tensor]:
    """(positions shape, inputs as (B, P, in)); token ids (B, P) for embeddings."""
    module = layer.module
    if layer.kind == "embedding":
        return x.shape[1:], x.reshape(x.shape[0], -1)
    if isinstance(module, nn.Conv2d):
        assert not isinstance(module.padding, str)  # excluded by _kind
        patches = nn.functional.unfold(
            x, module.kernel_size, module.dilation, module.padding, module.stride
        )
        return out.shape[2:], patches.transpose(1, 2)
    return x.shape[1:-1], x.reshape(x.shape[0], -1, x.shape[-1])


def _layer_grads(layer: _Layer, g: Tensor) -> Tensor:
    """Output gradients as (B, P, out)."""
    if layer.kind == "conv2d":
        return g.flatten(2).transpose(1, 2)
    return g.reshape(g.shape[0], -1, g.shape[-1])


def _add_gram(acc: Tensor, rows: Tensor, alpha: float = 1.0) -> None:
    """``acc[:n, :n] += alpha · rowsᵀ rows`` (n = rows.shape[1]) ON AND ABOVE THE DIAGONAL only.

    Large sides go in row blocks ``[lo, hi)``, each from its diagonal block rightwards
    (``acc[lo:hi, lo:] += rows[:, lo:hi]ᵀ rows[:, lo:]``, one GEMM per block): with k blocks the
    products cost (k + 1)/(2k) of the full one (k = 6 for a side of 784: 58%). The blocks below
    the diagonal are never computed; ``_symmetrize_`` fills them at the end.
    """
    n = rows.shape[1]
    if n == acc.shape[0] and n < _GRAM_BLOCKS_FROM:  # one product, no views (the common G)
        acc.addmm_(rows.T, rows, alpha=alpha)
        return
    for lo, hi in _gram_blocks(n):
        acc[lo:hi, lo:n].addmm_(rows[:, lo:hi].T, rows[:, lo:], alpha=alpha)


@functools.cache
def _gram_blocks(n: int) -> tuple[tuple[int, int], ...]:
    """Row blocks of a Gram matrix of side n: one block below ``_GRAM_BLOCKS_FROM``, else
    64-aligned blocks of ``_GRAM_BLOCK_WIDTH`` columns or more (at most ``_GRAM_MAX_BLOCKS``; the
    last block takes the remainder)."""
    if n < _GRAM_BLOCKS_FROM:
        return ((0, n),)
    width = max(_GRAM_BLOCK_WIDTH, -(-n // _GRAM_MAX_BLOCKS))
    width = -(-width // 64) * 64
    starts = list(range(0, n - width // 2, width))
    return tuple(zip(starts, [*starts[1:], n], strict=True))


@dataclass
class _Budget:
    """Bytes left for ``_GramSum`` buffers in one estimate."""

    left: int


@dataclass
class _GramSum:
    """``acc[:n, :n] += Σ_calls alpha · rowsᵀ rows`` (upper triangle, ``_add_gram``), with the rows
    of calls smaller than ``_GRAM_ROWS`` gathered into one product.

    Rows wait in a buffer of ``_GRAM_ROWS`` rows (allocated at the first small call while the
    estimate's ``_Budget`` allows; otherwise every call is its own product) until it is full, a
    call with another ``alpha`` comes, or ``flush()`` (``_finish``). The rows are copied in, so
    later in-place changes to the layer's inputs or gradients cannot reach them.
    """

    acc: Tensor
    budget: _Budget
    buffer: Tensor | None = None
    filled: int = 0
    alpha: float = 1.0

    def add(self, rows: Tensor, alpha: float = 1.0) -> None:
        k = rows.shape[0]
        if self.filled and (alpha != self.alpha or self.filled + k > _GRAM_ROWS):
            self.flush()
        if k >= _GRAM_ROWS or not self._has_buffer(rows):
            _add_gram(self.acc, rows, alpha)
            return
        assert self.buffer is not None  # _has_buffer
        self.buffer[self.filled : self.filled + k].copy_(rows)
        self.filled, self.alpha = self.filled + k, alpha
        if self.filled == _GRAM_ROWS:
            self.flush()

    def flush(self) -> None:
        """Add the gathered rows' product to ``acc``."""
        if self.filled:
            assert self.buffer is not None  # filled > 0 only after add() copied rows in
            _add_gram(self.acc, self.buffer[: self.filled], self.alpha)
            self.filled = 0

    def _has_buffer(self, rows: Tensor) -> bool:
        if self.buffer is None:
            size = _GRAM_ROWS * rows.shape[1] * rows.element_size()
            if size > self.budget.left:
                return False
            self.budget.left -= size
            self.buffer = rows.new_empty(_GRAM_ROWS, rows.shape[1])
        return True


def _add_augmented_gram(gram: _GramSum, rows: Tensor, bias: bool) -> None:
    """``gram.add`` of ``[rows | 1]`` (the ones column only with ``bias``), except its corner.

    The ones column is not materialised: its entries above the diagonal are the column sums of
    ``rows``, which are those of the rows with a 1 there since the other rows are zero
    (``_add_inputs``). The corner entry, the number of rows with a 1, is the layer's count M:
    ``_finish`` writes it once.
    """
    gram.add(rows)
    if bias:
        n = rows.shape[1]
        gram.acc[:n, n].add_(rows.sum(dim=0))  # (``acc[:n, n] += ...`` would copy it back)


def _symmetrize_(upper: Tensor, block: int = 128) -> Tensor:
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


def _all_finite(t: Tensor) -> bool:
    """Whether every entry is finite (a NaN/Inf entry makes the sum NaN/Inf: one reduction)."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _add_inputs(layer: _Layer, a: Tensor, keep: Tensor | None, approx: KFACApprox) -> None:
    """Add one call's inputs (B, P, in) to ``a_sum`` and the kept count to ``count``."""
    if layer.kind == "embedding":
        ids = a.reshape(-1) if keep is None else a[keep]
        counts = torch.bincount(ids, minlength=layer.a_sum.shape[0])
        layer.a_sum += counts.to(layer.a_sum.dtype)
        layer.count += ids.numel()
        return
    a = a.to(layer.a_sum.dtype)
    if approx == "expand":
        rows = a.reshape(-1, a.shape[-1]) if keep is None else a[keep]
        kept = rows.shape[0]
    elif keep is None:
        rows = a.sum(dim=1) / max(a.shape[1], 1)
        kept = rows.shape[0] if a.shape[1] else 0
    else:  # examples without a kept position get a zero row (bias entry included)
        n = keep.to(a.dtype).sum(dim=1, keepdim=True)
        rows = (a * keep.to(a.dtype).unsqueeze(-1)).sum(dim=1) / n.clamp(min=1)
        kept = int((n > 0).sum())
    layer.count += kept
    assert layer.a_gram is not None  # every kind but embeddings
    _add_augmented_gram(layer.a_gram, rows, layer.bias)


def _add_grads(
    layer: _Layer, g: Tensor, keep: Tensor | None, approx: KFACApprox, weight: float
) -> None:
    """Add ``weight`` · Σ g gᵀ of one call's output gradients to G."""
    g = _layer_grads(layer, g).to(layer.g_gram.acc.dtype)
    if approx == "expand" or layer.kind == "embedding":
        rows = g.reshape(-1, g.shape[-1]) if keep is None else g[keep]
    elif keep is None:
        rows = g.sum(dim=1)
    else:
        rows = (g * keep.to(g.dtype).unsqueeze(-1)).sum(dim=1)
    layer.g_gram.add(rows, weight)


@dataclass(frozen=True)
class _Tap:
    """One call of a covered module whose output gradient is wanted."""

    layer: _Layer
    edge: GradientEdge  # the output's place in the graph (``get_gradient_edge``)
    keep: Tensor | None
    approx: KFACApprox
    numel: int  # of the output


class _Recorder:
    """Forward hooks on the covered modules: add to A and note the outputs, during one batch.

    The output gradients are then asked of autograd directly (``collect``), not the weight
    gradients: the backward pass skips the weight (and bias) gradients that K-FAC never uses.
    """

    def __init__(self, layers: dict[str, _Layer], approx: KFACApprox) -> None:
        self.layers = layers
        self.approx = approx
        self.masks: _Masks | None = None
        self.batch_size = 0
        self.taps: list[_Tap] = []
        self.skipped: dict[str, str] = {}
        self.called: set[str] = set()

    def left_out(self) -> dict[str, str]:
        """Covered modules whose factors cannot be trusted, with the reason."""
        never = "never called by the forward pass (is its weight used functionally, as in "
        never += "nn.MultiheadAttention.out_proj?)"
        unseen = {name: never for name in self.layers if name not in self.called}
        return {**unseen, **self.skipped}

    def start_batch(self, masks: _Masks, batch_size: int) -> None:
        self.masks, self.batch_size, self.taps = masks, batch_size, []
        for layer in self.layers.values():
            layer.calls = 0

    def hook(self, name: str, module: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
        layer = self.layers[name]
        if self.masks is None or name in self.skipped or not isinstance(out, Tensor):
            return
        x = args[0]
        if x.shape[0] != self.batch_size:
            self.skipped[name] = (
                f"called with batch dimension {x.shape[0]}, not the batch's {self.batch_size}"
            )
            return
        layer.calls += 1
        self.called.add(name)
        approx = KFACApprox.EXPAND if layer.kind == "embedding" else self.approx
        if approx == "reduce" and layer.calls > 1:
            raise StructureError(
                f"module {name!r} is called more than once per forward pass; "
                "use kfac_approx='expand' for weight sharing across calls"
            )
        positions, a = _layer_inputs(layer, x.detach(), out)
        keep = self.masks.keep(positions, a.device)
        _add_inputs(layer, a, keep, approx)
        if out.requires_grad:
            # The edge rather than the tensor: an in-place op on the output later on (e.g.
            # nn.ReLU(inplace=True)) rebases the tensor onto that op, the edge stays put.
            self.taps.append(_Tap(layer, get_gradient_edge(out), keep, approx, out.numel()))

    def collect(
        self,
        root: Tensor,
        wrt: list[Tensor],
        weight: float = 1.0,
        rider: SharedPassDiagonal | None = None,
        **kwargs: Any,
    ) -> None:
        """One backward pass from ``root``: add ``weight`` · Σ g gᵀ of the noted outputs to G,
        and hand the gradients of the ``rider``'s outputs from the same pass to it (as one
        vector's; a rider that needs the vector itself, :attr:`SharedPassDiagonal.needs_vectors`,
        goes through :meth:`collect_vectors`)."""
        riding = [] if rider is None else rider.outputs
        if not self.taps and not riding:  # the pass still runs, for autograd's own errors
            torch.autograd.grad(root, wrt, allow_unused=True, **kwargs)
            if rider is not None:
                rider.add([], [])
            return
        edges = [tap.edge for tap in self.taps] + [get_gradient_edge(t) for t in riding]
        grads = torch.autograd.grad(root, edges, allow_unused=True, **kwargs)
        for tap, g in zip(self.taps, grads, strict=False):
            if g is not None:  # None: the output does not reach the loss
                _add_grads(tap.layer, g, tap.keep, tap.approx, weight)
        if rider is not None:
            rider.add([], [None if g is None else g.unsqueeze(0) for g in grads[len(self.taps) :]])

    def collect_vectors(
        self,
        outputs: Tensor,
        vectors: Iterable[Tensor],
        wrt: list[Tensor],
        weight: float,
        backward: Backward,
        rider: SharedPassDiagonal | None = None,
    ) -> None:
        """Backward passes of ``Σ_i v_irᵀ f_i`` for the output vectors ``v_r``, several per pass
        (``_batched``): add ``weight`` · Σ_r Σ g_r g_rᵀ of the noted outputs to G, and hand the
        gradients of the ``rider``'s outputs from the same passes to it.

        The ``R`` gradients of one pass, ``(R, B, ...)``, are ``R · B`` rows of one Gram product
        per layer (``reduce`` sums positions per vector and example, as one pass at a time would).
        """
        riding = [] if rider is None else rider.outputs
        per_vector = outputs.numel() + sum(tap.numel for tap in self.taps)
        per_vector += sum(t.numel() for t in riding)
        for group in groups(vectors, group_size(per_vector)):
            if not self.taps and not riding:  # the pass still runs, for autograd's errors
                for v in group:
                    root = (outputs * v).sum()
                    torch.autograd.grad(root, wrt, allow_unused=True, retain_graph=True)
                if rider is not None:
                    rider.add(group, [])
                continue
            edges = [tap.edge for tap in self.taps] + [get_gradient_edge(t) for t in riding]
            grads = backward.grads(outputs, edges, group)
            for tap, g in zip(self.taps, grads, strict=False):
                if g is None:  # the output does not reach the loss
                    continue
                keep = None if tap.keep is None else tap.keep.repeat(len(group), 1)
                _add_grads(tap.layer, g.flatten(0, 1), keep, tap.approx, weight)
            if rider is not None:
                rider.add(group, grads[len(self.taps) :])


def _backward(
    outputs: Tensor,
    targets: Tensor,
    losses: Tensor,
    wrt: list[Tensor],
    recorder: _Recorder,
    options: dict[str, Any],
) -> None:
    """The backward passes of one batch; the recorder collects the output gradients."""
    loss: Loss = options["loss"]
    backward: Backward = options["backward"]
    rider: SharedPassDiagonal | None = options["rider"]
    if options["fisher"] == "empirical" and (rider is None or not rider.needs_vectors):
        # the loss's own backward: the gradient it brings to the outputs is bit for bit the
        # vector ∂(Σ_i ℓ_i)/∂f below, without forming it (a second loss pass and a product)
        recorder.collect(losses.sum(), wrt, rider=rider)
    elif options["fisher"] == "empirical":  # the same pass, as the vector ∂(Σ_i ℓ_i)/∂f
        vector = loss_gradient(outputs.detach(), targets, loss, batch=options["batch"])
        recorder.collect_vectors(outputs, [vector], wrt, 1.0, backward, rider)
    elif options["fisher"] == "mc":
        k, f = options["mc_samples"], outputs.detach()
        draws = (sample_targets(f, targets, loss, options["generator"]) for _ in range(k))
        vectors = (loss_gradient(f, y, loss, batch=options["batch"]) for y in draws)
        recorder.collect_vectors(outputs, vectors, wrt, 1.0 / k, backward, rider)
    else:  # column c of S from every position at once (module docstring)
        hessian = OutputHessian(outputs, targets, loss)
        columns = (hessian.column(c) for c in range(hessian.classes))
        recorder.collect_vectors(outputs, columns, wrt, 1.0, backward)


def _check_ggn_size(outputs: Tensor, max_ggn_columns: int) -> None:
    columns = 1 if outputs.ndim == 1 else outputs.shape[-1]
    if columns > max_ggn_columns:
        raise ArgumentError(
            f"fisher='ggn' needs one backward pass per output column, here {columns} (> "
            f"max_ggn_columns={max_ggn_columns}); use fisher='mc' (one pass per sample) or "
            "raise max_ggn_columns"
        )


def _uncovered(model: nn.Module, layers: dict[str, _Layer]) -> list[str]:
    covered = set()
    for layer in layers.values():
        covered.add(id(layer.weight))
        if layer.bias:
            covered.add(id(layer.module.bias))
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]


def _finish(layers: dict[str, _Layer]) -> dict[str, tuple[Tensor, Tensor]]:
    """(A, G) of every layer, from its running sums (which it takes over and modifies)."""
    factors = {}
    for name, layer in layers.items():
        a = layer.a_sum
        if layer.a_gram is not None:  # every kind but embeddings
            layer.a_gram.flush()
            if layer.bias:  # the corner of the augmented Gram matrix (_add_augmented_gram)
                a[-1, -1] += layer.count
            a = _symmetrize_(a)
        a = a.div_(max(layer.count, 1))
        padding_idx = getattr(layer.module, "padding_idx", None)
        if layer.kind == "embedding" and padding_idx is not None:
            a[padding_idx] = 0
        layer.g_gram.flush()
        g = _symmetrize_(layer.g_gram.acc)
        if not (_all_finite(a) and _all_finite(g)):
            raise NonFiniteError(
                f"the K-FAC factors of {name!r} are NaN/Inf although every loss "
                "was finite: check the model for overflow (e.g. fp16)"
            )
        factors[name] = (a, g)
    return factors


def estimate_kfac_factors(
    model: nn.Module,
    data: Iterable[Any],
    *,
    fisher: Fisher | FisherName = "empirical",
    loss: LossFunction | LossName = "cross_entropy",
    kfac_approx: KFACApprox | KFACApproxName = "expand",
    mc_samples: int = 1,
    seed: int = 0,
    ignore_index: int = -100,
    modules: Sequence[str] | None = None,
    progress: bool = False,
    max_ggn_columns: int = 256,
    kfac_max_factor_side: int | None = MAX_FACTOR_SIDE,
    max_factor_side: int | None = _FIRST_NAME_UNSET,
    diagonal: bool = False,
) -> KFACFactors:
    """K-FAC factors (A, G) of every supported layer, normalised so A ⊗ G ≈ Σ_i curvature_i.

    See the module docstring for the formulas, the layout and what is left uncovered.

    Args:
        model: the network (used as given; call ``model.eval()`` to switch off dropout).
        data: batches ``(inputs, targets)`` or dicts with ``"labels"`` (``_data`` conventions).
        fisher: ``"empirical"``, ``"mc"`` (``mc_samples`` targets per example, seeded by
            ``seed``) or ``"ggn"`` (type-2: exact output Hessian, one backward pass per class).
        loss: ``"cross_entropy"`` or ``"mse"`` (ℓ_i = ½‖f_i − y_i‖²).
        kfac_approx: ``"expand"`` or ``"reduce"`` for layers with weight sharing.
        ignore_index: cross-entropy target value of positions to leave out.
        modules: restrict to these module names (default: every supported layer).
        progress: print one line per batch to stderr.
        max_ggn_columns: refuse ``fisher="ggn"`` with more output columns than this.
        kfac_max_factor_side: leave layers with a factor side above this uncovered, without
            allocating their factors (one warning names them; module docstring, *Factor size*);
            None: no limit.
        max_factor_side: ``kfac_max_factor_side`` under its first name (an alias, still
            accepted; give one of the two).
        diagonal: also collect, in the same pass and from the same output vectors, the diagonal
            Fisher (:func:`~gradmerge.estimate.diagonal.estimate_diagonal`'s values) of the
            parameters that may end without factors: those of no covered layer, and embeddings
            (a position embedding looked up with one row for the whole batch is left out when it
            is called; a large vocabulary is routed to a diagonal by ``kfac_curvature``). Stored
            in ``KFACFactors.diagonal``; ``fisher="empirical"`` and ``"mc"`` only (ignored for
            ``"ggn"``, whose diagonal needs per-position vectors).

    Returns:
        The factors, with ``num_examples`` = N and the uncovered parameter names.

    Raises:
        ArgumentError: unknown options, unknown ``modules``, empty data, too many GGN columns,
            a ``kfac_max_factor_side`` that is not a positive int or None.
        StructureError: no supported layer; targets that do not fit the outputs or the loss.
        NonFiniteError: a NaN/Inf loss (naming the batch) or factor.
    """
    fisher = check_fisher(fisher)
    kfac_approx = KFACApprox.check(kfac_approx, "kfac_approx")
    check_mc_samples(mc_samples, fisher)
    loss_spec = Loss(loss, ignore_index)
    if max_factor_side is not _FIRST_NAME_UNSET:
        if kfac_max_factor_side != MAX_FACTOR_SIDE:
            raise ArgumentError(
                "max_factor_side is the first name of kfac_max_factor_side: pass one of the two"
            )
        kfac_max_factor_side = max_factor_side
    kfac_max_factor_side = check_kfac_max_factor_side(kfac_max_factor_side)
    left_out: dict[str, str] = {}
    layers = _select_layers(model, modules, kfac_max_factor_side, left_out)
    if progress:
        for name, reason in left_out.items():
            print(f"kfac: {name!r} gets no factors: {reason}", file=sys.stderr)
    if not layers:  # every supported layer left out (e.g. by the size limit): count the examples
        total = sum(num_examples(targets) for _, _, targets in batches(data))
        return KFACFactors(
            {},
            {},
            {},
            {},
            total,
            fisher,
            kfac_approx,
            loss_spec.name,
            _uncovered(model, {}),
            left_out,
            kfac_max_factor_side,
        )
    recorder = _Recorder(layers, kfac_approx)
    wrt = [layer.weight for layer in layers.values()]
    rider = _rider(model, layers, fisher, loss_spec, mc_samples) if diagonal else None
    options = {
        "loss": loss_spec,
        "fisher": fisher,
        "mc_samples": mc_samples,
        "generator": torch.Generator().manual_seed(seed),
        "backward": Backward(),
        "rider": rider,
    }
    handles = [
        layer.module.register_forward_hook(partial(recorder.hook, name))
        for name, layer in layers.items()
    ]
    total = 0
    try:
        for index, inputs, targets in batches(data, device=wrt[0].device):
            batch = num_examples(targets)
            recorder.start_batch(_Masks.of_batch(inputs, targets, loss_spec), batch)
            with torch.enable_grad():
                with rider.recording(batch) if rider else contextlib.nullcontext():
                    outputs = forward(model, inputs)
                losses = per_example_loss(outputs, targets, loss_spec, batch=index)
                if fisher == "ggn":
                    _check_ggn_size(outputs, max_ggn_columns)
                if rider is not None:
                    rider.start(outputs, batch)
                _backward(outputs, targets, losses, wrt, recorder, {**options, "batch": index})
                if rider is not None:
                    rider.finish()
            total += batch
            if progress:
                print(f"kfac: batch {index}, {total} examples", file=sys.stderr)
    finally:
        for handle in handles:
            handle.remove()
        if rider is not None:
            rider.remove()
        recorder.masks = None
    for name, reason in recorder.left_out().items():
        warnings.warn(
            f"K-FAC gives no Kronecker factors to {name!r} ({reason}); gm.estimate_curvature "
            "covers its parameters with a diagonal block",
            stacklevel=2,
        )
        left_out[name] = reason
        del layers[name]
    return KFACFactors(
        factors=_finish(layers),
        has_bias={n: layer.bias for n, layer in layers.items()},
        transposed={n: layer.kind in ("conv1d", "embedding") for n, layer in layers.items()},
        counts={n: layer.count for n, layer in layers.items()},
        num_examples=total,
        fisher=fisher,
        kfac_approx=kfac_approx,
        loss=loss_spec.name,
        uncovered=_uncovered(model, layers),
        left_out=left_out,
        kfac_max_factor_side=kfac_max_factor_side,
        diagonal={} if rider is None else rider.values(),
    )


def _rider(
    model: nn.Module, layers: dict[str, _Layer], fisher: Fisher, loss: Loss, mc_samples: int
) -> SharedPassDiagonal | None:
    """The diagonal rider of ``estimate_kfac_factors(diagonal=True)``: every parameter of no
    covered layer and every embedding weight (None for ``"ggn"`` or when there is none)."""
    if fisher == "ggn":
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    params = _uncovered(model, layers)
    params += [names[id(x.weight)] for x in layers.values() if x.kind == "embedding"]
    return SharedPassDiagonal(model, params, fisher, loss, mc_samples) if params else None


__all__ = ["MAX_FACTOR_SIDE", "KFACFactors", "estimate_kfac_factors"]
