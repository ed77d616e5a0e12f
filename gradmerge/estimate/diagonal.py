"""Diagonal curvature estimates: the diagonal empirical Fisher, Monte-Carlo Fisher and exact GGN.

All three are SUMS over the examples ``i`` (rows of the batches, see ``_data``) of squared
per-example vectors, ``diag(Σ_i Σ_r (J_iᵀ v_ir)(J_iᵀ v_ir)ᵀ) = Σ_i Σ_r (J_iᵀ v_ir)²`` with
``J_i = ∂f_i/∂θ`` the Jacobian of example ``i``'s model output and ``v_ir`` vectors in output space:

- ``"empirical"``: ``v_i = ∇_f ℓ(f_i, y_i)``, giving ``Σ_i (∇_θ ℓ_i(θ; y_i))²``.
- ``"mc"``: ``v_ij = ∇_f ℓ(f_i, ŷ_ij)`` with ``ŷ_ij`` drawn from the model's predictive
  distribution, weighted ``1/k``: ``Σ_i (1/k) Σ_{j≤k} (∇_θ ℓ_i(θ; ŷ_ij))²``, an unbiased estimate
  of the Fisher (= the GGN for cross-entropy on logits and for mse).
- ``"ggn"``: the columns of a factor ``Λ_i = S_i S_iᵀ`` of the loss' output Hessian, giving the
  exact ``diag(Σ_i J_iᵀ Λ_i J_i)``. For mse ``S = I``; for cross-entropy, per position,
  ``Λ = diag(p) − ppᵀ = S Sᵀ`` with ``S = diag(√p) − p√pᵀ`` (column ``c`` is ``√p_c (e_c − p)``;
  one helper, ``_output_hessian.OutputHessian``, for every estimator).

One forward pass per batch; the backward pass of ``Σ_i v_irᵀ f_i`` for a vector ``r`` (1 for
``"empirical"``, ``k`` for ``"mc"``, ``C × positions`` for ``"ggn"``) yields every example's output
gradient ``g_ir`` at once, from which module hooks form the squared per-example gradients
(``_hooks``). Several vectors share ONE vmapped backward pass (``_batched``). For layers with one
position per example (an MLP's Linear layers) ``Σ_r (g_ir a_iᵀ)² = (Σ_r g_ir²)(a_i²)ᵀ``: the
squares are summed over ``r`` first and the parameter squares cost one matmul per layer and
batch, whatever the number of vectors — the exact GGN of a C-class MLP costs a forward pass, a
batched backward pass of C vectors and one product per layer, as BackPACK's ``DiagGGNExact``
(which backpropagates the C columns of S through the layers at once, Dangel et al. 2020).

Reference: Dangel, Kunstner & Hennig (2020), "BackPACK: Packing more into backprop".
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from gradmerge.curvature.diagonal import Diagonal
from gradmerge.errors import ArgumentError
from gradmerge.estimate import _hooks
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
from gradmerge.estimate.options import (
    EstimateOptions,
    Fisher,
    FisherName,
    LossFunction,
    LossName,
    check_fisher,
    check_mc_samples,
    check_params,
)

MAX_GGN_COLUMNS = 4096
"""Most backward passes per batch that ``fisher="ggn"`` accepts (classes × positions)."""


def estimate_diagonal(
    model: nn.Module,
    data: Iterable[Any],
    *,
    fisher: Fisher | FisherName = EstimateOptions.fisher,  # type: ignore[assignment]  # the declared default
    loss: LossFunction | LossName = EstimateOptions.loss,
    mc_samples: int = EstimateOptions.mc_samples,
    seed: int = EstimateOptions.seed,
    ignore_index: int = EstimateOptions.ignore_index,
    params: Sequence[str] | None = None,
    progress: bool = False,
) -> Diagonal:
    """The diagonal of a Fisher/GGN of ``model`` on ``data``, a SUM over examples.

    With ``ℓ_i`` the loss of example ``i`` (one row of a batch; a sequence's loss is the sum of its
    token losses, positions whose target is ``ignore_index`` excluded):

    - ``fisher="empirical"``: ``Σ_i (∇_θ ℓ_i(θ; y_i))²``, squared per example (never the square
      of a batch gradient).
    - ``fisher="mc"``: ``Σ_i (1/k) Σ_{j≤k} (∇_θ ℓ_i(θ; ŷ_ij))²``, ``ŷ_ij`` sampled from the model
      (``k = mc_samples``). Draws come from one ``torch.Generator`` seeded with ``seed``, in the
      order batch by batch, then ``j = 1..k``, each ``_data.sample_targets(outputs, targets,
      loss, generator)`` on the whole batch's outputs.
    - ``fisher="ggn"``: the exact ``diag(Σ_i J_iᵀ Λ_i J_i)``, ``Λ_i`` the Hessian of the loss in
      the outputs (identity for mse, ``diag(p) − ppᵀ`` per position for cross-entropy). Costs the
      backward of one vector per column of a factor of ``Λ`` (batched, several per pass):
      ``classes × positions`` for cross-entropy (positions ignored in every example skipped),
      the output size for mse. Refused above ``MAX_GGN_COLUMNS``: use ``fisher="mc"`` there.

    Cost: one forward pass and one backward pass per batch (``"empirical"``), plus the squared
    per-example gradients of ``nn.Linear``, ``nn.Conv2d`` (groups 1, zero padding),
    ``nn.Embedding``, ``nn.LayerNorm`` and transformers' ``Conv1D`` from module hooks. Other
    trainable parameters (custom ``nn.Parameter`` s, subclasses overriding ``forward``, weights
    used outside their module, a batch-1 input that is not an embedding lookup) take an exact but
    slow fallback: one backward pass per example, restricted to those parameters; a warning names
    them. Tied weights (GPT-2's embedding and head) sum their per-example gradients before
    squaring.

    Assumptions: layers see batch-first inputs (dim 0 is the example) and examples do not
    interact (BatchNorm in training mode couples them: call ``model.eval()``). The model is run
    in the mode it is in: with dropout active the estimate is itself random. Gradient
    checkpointing is refused.

    Args:
        model: the network; ``model(inputs)`` or ``model(**inputs)`` gives logits/predictions.
        data: iterable of batches ``(inputs, targets)`` or dicts with ``"labels"`` (see
            ``gradmerge.estimate._data``); moved to the parameters' device.
        fisher: ``"empirical"``, ``"mc"`` or ``"ggn"``.
        loss: ``"cross_entropy"`` (logits on the last dim) or ``"mse"`` (``½‖f − y‖²``).
        mc_samples: samples per example for ``fisher="mc"``.
        seed: seed of the Monte-Carlo draws.
        ignore_index: cross-entropy target marking a position to leave out.
        params: names of the trainable parameters to cover (default: all of them).
        progress: print a batch counter to stderr.

    Returns:
        A :class:`~gradmerge.Diagonal` keyed by parameter name, on the parameters' device, in
        their dtype (float32 for bf16/fp16 parameters, accumulated in float32).

    Raises:
        ArgumentError: unknown ``fisher``/``loss``/parameter names, ``mc_samples < 1``, no
            trainable parameters, empty ``data``, too many GGN columns, gradient checkpointing.
        StructureError: batches or targets that do not fit the loss.
        NonFiniteError: a NaN/Inf loss (the batch index is named).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from gradmerge.estimate.diagonal import estimate_diagonal
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> data = [(torch.randn(8, 3), torch.randint(0, 2, (8,)))]
        >>> F = estimate_diagonal(model, data, fisher="empirical")
        >>> sorted(F.values), F.values["0.weight"].shape
        (['0.bias', '0.weight', '2.bias', '2.weight'], torch.Size([4, 3]))
    """
    spec = Loss(loss, ignore_index)
    fisher = check_fisher(fisher)
    check_mc_samples(mc_samples)
    selected = _select(model, params)
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise ArgumentError(
            "gradient checkpointing is on: the recomputed forward hides the layers from the "
            "estimator; call model.gradient_checkpointing_disable() first"
        )
    state = _State(selected, fisher, mc_samples, spec, torch.Generator().manual_seed(seed))
    modules = _covered_modules(model, selected)
    frozen = [p for p in model.parameters() if p.requires_grad and id(p) not in state.names]
    recorder = _hooks.Recorder(modules)
    try:
        for p in frozen:
            p.requires_grad_(False)  # spare the graph of parameters nobody asked for
        with torch.enable_grad():
            for index, inputs, targets in batches(data, device=state.device):
                _batch(model, recorder, state, index, inputs, targets)
                if progress:
                    print(f"\rdiagonal {fisher}: batch {index + 1}", end="", file=sys.stderr)
    finally:
        recorder.remove()
        for p in frozen:
            p.requires_grad_(True)
        if progress:
            print(file=sys.stderr)
    if fisher == "mc":
        for value in state.acc.values():
            value /= mc_samples
    return Diagonal(state.acc)


@dataclass
class _State:
    """What the batches share: the parameters, the accumulators and the sampler."""

    params: dict[str, nn.Parameter]
    fisher: Fisher
    mc_samples: int
    loss: Loss
    generator: torch.Generator
    acc: dict[str, Tensor] = field(init=False)
    names: dict[int, str] = field(init=False)
    warned: bool = False
    backward: Backward = field(default_factory=Backward)  # several vectors per pass

    def __post_init__(self) -> None:
        self.acc = {
            n: torch.zeros_like(p, dtype=accumulation_dtype(p)) for n, p in self.params.items()
        }
        self.names = {id(p): n for n, p in self.params.items()}

    @property
    def device(self) -> torch.device:
        return next(iter(self.params.values())).device


def _select(model: nn.Module, params: Sequence[str] | None) -> dict[str, nn.Parameter]:
    """The trainable parameters to cover, by name (all, or the subset ``params``)."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not trainable:
        raise ArgumentError(
            "the model has no trainable parameters (none requires a gradient): nothing to estimate"
        )
    params = check_params(params)
    if params is None:
        return trainable
    unknown = [n for n in params if n not in trainable]
    if unknown:
        raise ArgumentError(
            f"params names {unknown} are not trainable parameters of the model; "
            f"choose from {sorted(trainable)}"
        )
    if not params:
        raise ArgumentError("params is empty: name at least one parameter, or pass None for all")
    return {n: trainable[n] for n in params}


def _covered_modules(
    model: nn.Module, selected: dict[str, nn.Parameter]
) -> dict[nn.Module, _hooks.Rule]:
    """Modules with a fast rule that own at least one selected parameter."""
    ids = {id(p) for p in selected.values()}
    out: dict[nn.Module, _hooks.Rule] = {}
    for module in model.modules():
        if any(id(p) in ids for p in module.parameters(recurse=False)):
            rule = _hooks.rule_for(module)
            if rule is not None:
                out[module] = rule
    return out


def _batch(
    model: nn.Module,
    recorder: _hooks.Recorder,
    state: _State,
    index: int,
    inputs: Inputs,
    targets: Tensor,
) -> None:
    """Add one batch's contribution to ``state.acc``."""
    recorder.batch = num_examples(targets)
    try:
        outputs = forward(model, inputs)
    finally:
        recorder.batch = None
    calls = recorder.take()
    vectors = _output_vectors(outputs, targets, state, index)
    first = next(vectors, None)  # validates targets and loss before any backward pass
    if first is None or not outputs.requires_grad:
        return  # every position ignored (ggn), or outputs free of the selected parameters
    plan = _plan(outputs, calls, state, num_examples(targets))
    _warn_fallback(plan, state)
    squares = _Squares(plan, state)
    per_vector = outputs.numel() + sum(call.output.numel() for call in squares.calls)
    for group in groups(_chain(first, vectors), group_size(per_vector)):
        squares.add(outputs, group)
        for v in group:
            _add_fallback(outputs, v, plan.fallback, state)
    squares.finish()


def _warn_fallback(plan: _Plan, state: _State) -> None:
    if plan.fallback and not state.warned:
        state.warned = True
        warnings.warn(
            f"no fast per-example rule covers {plan.fallback}: their diagonal is computed with "
            "one backward pass per example (exact, slow)",
            stacklevel=4,
        )


class SharedPassDiagonal:
    """The diagonal Fisher of some parameters, collected during another estimator's pass.

    K-FAC gives factors to the layers it supports; the rest of a model (LayerNorms, position
    embeddings, a vocabulary too large for a factor) gets the diagonal of the same Fisher. The
    shared-pass diagonal collects it in the K-FAC pass instead of a second pass over the data: its
    forward hooks record the calls while the host runs the forward pass (:meth:`recording`),
    :meth:`start` plans the batch, the host asks autograd for the gradients of :attr:`outputs`
    together with its own, from the SAME output vectors ``v_ir``, and hands them to :meth:`add`.
    With the vectors of ``fisher="empirical"`` or ``"mc"`` (the same draws in the same order), the
    sums are :func:`estimate_diagonal`'s: ``Σ_i (1/k) Σ_r (J_iᵀ v_ir)²`` (``k`` = ``mc_samples``, 1
    for ``"empirical"``).

    Args:
        model: the network the host runs.
        params: the trainable parameters to cover, by name.
        fisher: ``"empirical"`` or ``"mc"`` (the exact GGN's vectors are per-position columns
            here, which K-FAC's pass does not use).
        loss: the host's loss.
        mc_samples: the host's vectors per example (``fisher="mc"``).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from gradmerge.estimate._data import Loss
        >>> from gradmerge.estimate.diagonal import SharedPassDiagonal, estimate_diagonal
        >>> model = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))
        >>> x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> shared = SharedPassDiagonal(model, ["1.weight"], "empirical", Loss("cross_entropy"), 1)
        >>> with shared.recording(4):
        ...     f = model(x)
        >>> shared.start(f, 4)
        >>> v = torch.autograd.grad(nn.functional.cross_entropy(f, y, reduction="sum"), f)[0]
        >>> grads = torch.autograd.grad(f, shared.outputs, v)  # for R = 1 vector: (1, *shape)
        >>> shared.add([v], [g.unsqueeze(0) for g in grads])
        >>> shared.finish()
        >>> ref = estimate_diagonal(model, [(x, y)], params=["1.weight"]).values["1.weight"]
        >>> torch.allclose(shared.values()["1.weight"], ref)
        True
    """

    def __init__(
        self,
        model: nn.Module,
        params: Sequence[str],
        fisher: Fisher | FisherName,
        loss: Loss,
        mc_samples: int,
    ) -> None:
        fisher = check_fisher(fisher)
        if fisher not in ("empirical", "mc"):
            raise ArgumentError(
                f"a shared-pass diagonal takes fisher 'empirical' or 'mc', not {fisher!r}"
            )
        selected = _select(model, params)
        self.state = _State(selected, fisher, mc_samples, loss, torch.Generator())
        self.recorder = _hooks.Recorder(_covered_modules(model, selected))
        self._squares: _Squares | None = None
        self._outputs: Tensor | None = None
        self._fallback: list[str] = []

    @contextmanager
    def recording(self, batch: int) -> Iterator[None]:
        """Record the covered modules' calls during the host's forward pass of ``batch`` rows."""
        self.recorder.batch = batch
        try:
            yield
        finally:
            self.recorder.batch = None

    def start(self, outputs: Tensor, batch: int) -> None:
        """Plan the batch whose forward pass gave ``outputs`` (``batch`` examples)."""
        calls = self.recorder.take()
        plan = _Plan({}, [])
        if outputs.requires_grad:
            plan = _plan(outputs, calls, self.state, batch)
            _warn_fallback(plan, self.state)
        self._squares, self._outputs, self._fallback = (
            _Squares(plan, self.state),
            outputs,
            plan.fallback,
        )

    @property
    def outputs(self) -> list[Tensor]:
        """The tensors whose gradients :meth:`add` takes, in order (none before :meth:`start`)."""
        return [] if self._squares is None else self._squares.outputs

    @property
    def needs_vectors(self) -> bool:
        """Whether :meth:`add` needs the output vectors themselves (parameters left to the exact
        per-example fallback); else the gradients of :attr:`outputs` are enough."""
        return bool(self._fallback)

    def add(self, vectors: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
        """Add the squares for the output ``vectors`` of one backward pass; ``grads``: the
        gradients of :attr:`outputs`, each ``(R, *shape)`` for the ``R`` vectors (``vectors``
        may be left empty when :attr:`needs_vectors` is False)."""
        assert self._squares is not None and self._outputs is not None, "start() first"
        if self._squares.calls:
            self._squares.add_grads(grads)
        for v in vectors:
            _add_fallback(self._outputs, v, self._fallback, self.state)

    def finish(self) -> None:
        """Close the batch."""
        if self._squares is not None:
            self._squares.finish()
        self._squares = self._outputs = None

    def values(self) -> dict[str, Tensor]:
        """Parameter name → its diagonal, a sum over the examples seen (with one vector per
        example, the running sums themselves, not copies: a tied GPT-2 embedding's is 154 MB)."""
        k = self.state.mc_samples if self.state.fisher == "mc" else 1
        if k == 1:
            return dict(self.state.acc)
        return {name: value / k for name, value in self.state.acc.items()}

    def remove(self) -> None:
        """Remove the forward hooks."""
        self.recorder.remove()


def _chain(first: Tensor, rest: Iterator[Tensor]) -> Iterator[Tensor]:
    yield first
    yield from rest


# ----- output-space vectors v_ir --------------------------------------------------------------
def _output_vectors(
    outputs: Tensor, targets: Tensor, state: _State, index: int
) -> Iterator[Tensor]:
    """The vectors ``v_ir`` of the chosen Fisher, each of the outputs' shape (row i: example i)."""
    f = outputs.detach()
    if state.fisher == "empirical":
        yield loss_gradient(f, targets, state.loss, batch=index)
        return
    per_example_loss(f, targets, state.loss, batch=index)  # checks the observed targets
    if state.fisher == "mc":
        for _ in range(state.mc_samples):
            drawn = sample_targets(f, targets, state.loss, state.generator)
            yield loss_gradient(f, drawn, state.loss, batch=index)
    else:
        yield from _ggn_columns(f, targets, state.loss)


def _ggn_columns(f: Tensor, targets: Tensor, loss: Loss) -> Iterator[Tensor]:
    """Columns of ``S`` with ``S Sᵀ = Λ`` (``_output_hessian``), block-diagonal over positions:
    column ``(s, c)`` is ``S_s[:, c]`` at position ``s`` and 0 elsewhere, for every example at
    once (positions ignored in every example are skipped: their columns are 0)."""
    hessian = OutputHessian(f, targets, loss)
    batch, classes = f.shape[0], hessian.classes
    positions = f.numel() // max(batch * classes, 1)
    kept = list(range(positions))
    if hessian.keep is not None:
        kept = torch.nonzero(hessian.keep.reshape(batch, positions).any(0)).flatten().tolist()
    _check_columns(len(kept) * classes, f"{len(kept)} positions × {classes} outputs")
    for c in range(classes):
        column = hessian.column(c).reshape(batch, positions, classes)
        for s in kept:
            if positions == 1:
                yield column.reshape(f.shape)
                continue
            v = torch.zeros_like(column)
            v[:, s] = column[:, s]
            yield v.reshape(f.shape)


def _check_columns(columns: int, what: str) -> None:
    if columns > MAX_GGN_COLUMNS:
        raise ArgumentError(
            f"fisher='ggn' needs one backward pass per column of the loss Hessian's factor: "
            f"{what} = {columns} > {MAX_GGN_COLUMNS} per batch; use fisher='mc' (unbiased, "
            "mc_samples backward passes) instead"
        )


# ----- squared per-example gradients ----------------------------------------------------------
@dataclass
class _Plan:
    """Per parameter: the calls whose hooks give its per-example gradients, or the fallback."""

    fast: dict[str, list[tuple[_hooks.Call, str]]]
    fallback: list[str]


def _plan(outputs: Tensor, calls: list[_hooks.Call], state: _State, batch: int) -> _Plan:
    """Fast path for a parameter iff every use of it in the graph is a usable recorded call."""
    edges = _hooks.param_edge_counts(outputs, state.names)
    uses: dict[str, list[tuple[_hooks.Call, str]]] = {}
    unusable: set[str] = set()
    for call in calls:
        for role, p in call.module.named_parameters(recurse=False):
            name = state.names.get(id(p))
            if name is None:
                continue
            uses.setdefault(name, []).append((call, role))
            if not call.usable(batch):
                unusable.add(name)
    fast = {n: u for n, u in uses.items() if n not in unusable and len(u) == edges[n]}
    fallback = [n for n in state.params if n not in fast and edges[n] > 0]
    return _Plan(fast, fallback)


class _Squares:
    """The fast path of one batch: squared per-example gradients from the recorded calls.

    ``add`` backpropagates a group of output vectors ``v_r`` in one pass and gets every recorded
    call's output gradients ``g_r``. For a parameter of a :meth:`~_hooks.Rule.separable` call
    (one position per example, used once) only ``Σ_r g_r ∘ g_r`` is kept, and ``finish`` forms
    ``Σ_i Σ_r (∇_θ ℓ_i^(r))²`` from it once per batch (for a Linear layer ONE matmul
    ``(Σ_r g_r²)ᵀ (a²)``, whatever the number of vectors: the exact GGN's C columns cost one
    product, as in BackPACK's DiagGGNExact). Other parameters (weight sharing over positions,
    tied weights) square their per-example gradients vector by vector.
    """

    def __init__(self, plan: _Plan, state: _State) -> None:
        self.state = state
        self.separable: list[tuple[str, _hooks.Call, str]] = []
        self.per_vector: dict[str, list[tuple[_hooks.Call, str]]] = {}
        for name, uses in plan.fast.items():
            call, role = uses[0]
            if len(uses) == 1 and call.rule.separable(call):
                self.separable.append((name, call, role))
            else:
                self.per_vector[name] = uses
        unique = {id(c): c for uses in plan.fast.values() for c, _ in uses}
        self.calls = list(unique.values())
        self.g2: dict[int, Tensor] = {}  # id(call) → Σ_r g_r ∘ g_r, (B, *output.shape[1:])

    @property
    def outputs(self) -> list[Tensor]:
        """The recorded calls' outputs, whose gradients :meth:`add_grads` takes."""
        return [c.output for c in self.calls]

    def add(self, outputs: Tensor, vectors: list[Tensor]) -> None:
        if self.calls:
            self.add_grads(self.state.backward.grads(outputs, self.outputs, vectors))

    def add_grads(self, grads: Sequence[Tensor | None]) -> None:
        """Add the gradients of :attr:`outputs` for ``R`` output vectors, each ``(R, *shape)``."""
        g_of = {id(c): g for c, g in zip(self.calls, grads, strict=True)}  # (R, *output.shape)
        vectors = next((g.shape[0] for g in grads if g is not None), 0)
        for r in range(vectors if self.per_vector else 0):
            g_r = {key: None if g is None else g[r] for key, g in g_of.items()}
            for name, uses in self.per_vector.items():
                acc = self.state.acc[name]
                if len(uses) > 1:
                    _add_shared(acc, uses, g_r)
                elif (g := g_r[id(uses[0][0])]) is not None:
                    acc += uses[0][0].rule.sq_sum(uses[0][0], g, uses[0][1], acc.dtype)
        for name, call, _ in self.separable:
            g = g_of.pop(id(call), None)  # popped: a call with weight and bias squares once
            if g is None:
                continue
            dtype = self.state.acc[name].dtype
            if id(call) not in self.g2:
                self.g2[id(call)] = torch.zeros(g.shape[1:], dtype=dtype, device=g.device)
            g2 = self.g2[id(call)]
            for g_r in g.to(dtype):  # fused, no (R, B, ...) temporary; g itself is not modified
                g2.addcmul_(g_r, g_r)

    def finish(self) -> None:
        for name, call, role in self.separable:
            g2 = self.g2.get(id(call))
            if g2 is not None:
                acc = self.state.acc[name]
                acc += call.rule.sq_sum_of_squares(call, g2, role, acc.dtype)


def _add_shared(
    acc: Tensor, uses: list[tuple[_hooks.Call, str]], g_of: Mapping[int, Tensor | None]
) -> None:
    """A parameter used by several calls (tied weights, a module called twice): sum, then square.

    Each chunk's per-example gradients are written into one buffer by the calls' rules in turn
    (the first sets it, the others add; an embedding's few rows go last, a product first), and
    squared into ``acc`` example by example (``addcmul_``): per example of a tied GPT-2
    embedding/head (50257 × 768), one product and one fused square-and-add pass.
    """
    live = [(c, r, g) for c, r in uses if (g := g_of[id(c)]) is not None]
    if not live:
        return
    live.sort(key=lambda use: use[0].rule.sparse_rows)
    buffer = torch.empty(0, dtype=acc.dtype, device=acc.device)
    for lo, hi in _hooks.chunks(live[0][2].shape[0], acc.numel()):
        if buffer.shape[0] != hi - lo:
            buffer = torch.empty((hi - lo, *acc.shape), dtype=acc.dtype, device=acc.device)
        for k, (call, role, g) in enumerate(live):
            call.rule.per_example_into(call, g, role, lo, hi, buffer, add=k > 0)
        for per_example in buffer:
            acc.addcmul_(per_example, per_example)


def _add_fallback(outputs: Tensor, v: Tensor, names: list[str], state: _State) -> None:
    """Exact per-example gradients of ``names``: one backward pass of ``v_iᵀ f_i`` per example."""
    if not names:
        return
    params = [state.params[n] for n in names]
    for i in range(v.shape[0]):
        if not bool(v[i].any()):
            continue
        v_i = torch.zeros_like(v)
        v_i[i] = v[i]
        root = (outputs * v_i).sum()  # v_iᵀ f_i, a scalar (see _batched.Backward)
        grads = torch.autograd.grad(root, params, retain_graph=True, allow_unused=True)
        for name, g in zip(names, grads, strict=True):
            if g is not None:
                g = g.to(state.acc[name].dtype)
                state.acc[name].addcmul_(g, g)
