r"""K-FAC Kronecker factors of the Fisher/GGN, per layer, as a SUM over examples.

For a layer with weight W (viewed as ``(out, in)``, see *Layout*) K-FAC approximates the curvature
block of its parameters by ``A ⊗ G``, the operator ``V ↦ G V A`` on ``V = [W | b]`` (the bias, if
any, is the LAST input column, and the inputs are augmented with a 1). The factors are normalised
so that ``A ⊗ G`` approximates the SUM over examples Σ_i of the per-example curvature
(docs/architecture.md):

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
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from gradmerge.errors import ArgumentError
from gradmerge.estimate._batched import Backward
from gradmerge.estimate._data import Loss, batches, forward, num_examples, per_example_loss
from gradmerge.estimate._kfac_layers import (
    Layer,
    Masks,
    finished_factors,
    select_layers,
    uncovered_params,
)
from gradmerge.estimate._kfac_pass import Recorder, backward_passes, check_ggn_size
from gradmerge.estimate.diagonal import SharedPassDiagonal
from gradmerge.estimate.options import (
    MAX_FACTOR_SIDE,
    EstimateOptions,
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


def estimate_kfac_factors(
    model: nn.Module,
    data: Iterable[Any],
    *,
    fisher: Fisher | FisherName = EstimateOptions.fisher,  # type: ignore[assignment]  # the declared default
    loss: LossFunction | LossName = EstimateOptions.loss,
    kfac_approx: KFACApprox | KFACApproxName = EstimateOptions.kfac_approx,
    mc_samples: int = EstimateOptions.mc_samples,
    seed: int = EstimateOptions.seed,
    ignore_index: int = EstimateOptions.ignore_index,
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
    layers = select_layers(model, modules, kfac_max_factor_side, left_out)
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
            uncovered_params(model, {}),
            left_out,
            kfac_max_factor_side,
        )
    recorder = Recorder(layers, kfac_approx)
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
            recorder.start_batch(Masks.of_batch(inputs, targets, loss_spec), batch)
            with torch.enable_grad():
                with rider.recording(batch) if rider else contextlib.nullcontext():
                    outputs = forward(model, inputs)
                losses = per_example_loss(outputs, targets, loss_spec, batch=index)
                if fisher == "ggn":
                    check_ggn_size(outputs, max_ggn_columns)
                if rider is not None:
                    rider.start(outputs, batch)
                backward_passes(
                    outputs, targets, losses, wrt, recorder, {**options, "batch": index}
                )
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
        factors=finished_factors(layers),
        has_bias={n: layer.bias for n, layer in layers.items()},
        transposed={n: layer.kind in ("conv1d", "embedding") for n, layer in layers.items()},
        counts={n: layer.count for n, layer in layers.items()},
        num_examples=total,
        fisher=fisher,
        kfac_approx=kfac_approx,
        loss=loss_spec.name,
        uncovered=uncovered_params(model, layers),
        left_out=left_out,
        kfac_max_factor_side=kfac_max_factor_side,
        diagonal={} if rider is None else rider.values(),
    )


def _rider(
    model: nn.Module, layers: dict[str, Layer], fisher: Fisher, loss: Loss, mc_samples: int
) -> SharedPassDiagonal | None:
    """The diagonal rider of ``estimate_kfac_factors(diagonal=True)``: every parameter of no
    covered layer and every embedding weight (None for ``"ggn"`` or when there is none)."""
    if fisher == "ggn":
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    params = uncovered_params(model, layers)
    params += [names[id(x.weight)] for x in layers.values() if x.kind == "embedding"]
    return SharedPassDiagonal(model, params, fisher, loss, mc_samples) if params else None


__all__ = ["MAX_FACTOR_SIDE", "KFACFactors", "estimate_kfac_factors"]
