"""Per-example gradients of common layers from module hooks (no loop over examples, no vmap).

A forward hook saves a layer's input ``a`` and its output ``y``; one backward pass of the SUM of
the per-example losses then gives ``g = ∂(Σ_j ℓ_j)/∂y`` whose row ``g_i`` is example ``i``'s own
output gradient (examples do not interact). From ``a`` and ``g`` each :class:`Rule` forms

- ``per_example``: the per-example parameter gradients ``∇_θ ℓ_i`` of a slice of the batch, and
- ``sq_sum``: ``Σ_i (∇_θ ℓ_i)²`` directly, where a cheaper formula than squaring ``per_example``
  exists (Linear without positions: ``(g²)ᵀ(a²)``, one matmul; Embedding: sparse rows).

Layers with weight sharing over positions (sequences, pixels) sum over the positions ``s`` of one
example BEFORE squaring: ``∇_W ℓ_i = Σ_s g_is a_isᵀ``.

Rules apply only to the exact classes whose ``forward`` is the stock one (a subclass that
overrides ``forward`` computes something else), and assume batch-first inputs: dim 0 of a layer's
input is the example. The estimator checks every other assumption it can (see
:func:`param_edge_counts`) and routes the parameters it cannot vouch for to an exact fallback.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

CHUNK_ELEMENTS = 2**25
"""Most elements of per-example gradients materialised at once (128 MiB in float32)."""


def chunks(batch: int, numel: int) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` slices of the batch holding at most ``CHUNK_ELEMENTS`` per-example values."""
    step = max(1, CHUNK_ELEMENTS // max(1, numel))
    for lo in range(0, batch, step):
        yield lo, min(batch, lo + step)


@dataclass
class Call:
    """One call of a hooked module: its input, its output and the output's version counter."""

    module: nn.Module
    rule: Rule
    inputs: Tensor | None
    output: Tensor
    version: int

    def usable(self, batch: int) -> bool:
        """Whether the rule's per-example formulas hold for this call (batch-first, untouched)."""
        return (
            self.inputs is not None
            and self.output._version == self.version
            and self.rule.batch_ok(self.inputs, self.output, batch)
        )


class Rule:
    """Per-example gradients of one layer type's parameters (``role`` is
    ``"weight"``/``"bias"``)."""

    broadcasts_batch = False  # whether a batch-1 input may be expanded to the batch (see Recorder)
    sparse_rows = False  # whether a per-example gradient touches few rows (added last, in place)

    def applies(self, module: nn.Module) -> bool:
        raise NotImplementedError

    def batch_ok(self, inputs: Tensor, output: Tensor, batch: int) -> bool:
        return inputs.ndim >= 2 and inputs.shape[0] == batch and output.shape[0] == batch

    def per_example(
        self, call: Call, g: Tensor, role: str, lo: int, hi: int, dtype: torch.dtype
    ) -> Tensor:
        """``∇_θ ℓ_i`` for examples ``lo ≤ i < hi``, shape ``(hi − lo, *θ.shape)``."""
        raise NotImplementedError

    def per_example_into(
        self, call: Call, g: Tensor, role: str, lo: int, hi: int, out: Tensor, add: bool
    ) -> None:
        """``out`` (``(hi − lo, *θ.shape)``, contiguous) ``+=`` (``add``) or ``=`` the per-example
        gradients of examples ``lo ≤ i < hi`` (default: :meth:`per_example` copied in; rules with
        a product write it in place)."""
        per_example = self.per_example(call, g, role, lo, hi, out.dtype)
        out.add_(per_example) if add else out.copy_(per_example)

    def sq_sum(self, call: Call, g: Tensor, role: str, dtype: torch.dtype) -> Tensor:
        """``Σ_i (∇_θ ℓ_i)²`` over the batch (default: square ``per_example`` chunk by chunk)."""
        param = _param(call, role)
        total = torch.zeros(param.shape, dtype=dtype, device=param.device)
        for lo, hi in chunks(g.shape[0], param.numel()):
            total += self.per_example(call, g, role, lo, hi, dtype).square_().sum(0)
        return total

    def separable(self, call: Call) -> bool:
        """Whether ``∇_θ ℓ_i`` is ``g_i`` times something that does not depend on ``g``, entry by
        entry (no positions to sum over): then ``(∇_θ ℓ_i)²`` is linear in ``g_i²`` and the squares
        of several output vectors ``r`` can be summed BEFORE forming the parameter squares,
        ``Σ_r (∇_θ ℓ_i^(r))² = sq_sum_of_squares(Σ_r g_ir²)`` (:meth:`sq_sum_of_squares`)."""
        return False

    def sq_sum_of_squares(self, call: Call, g2: Tensor, role: str, dtype: torch.dtype) -> Tensor:
        """``Σ_i Σ_r (∇_θ ℓ_i^(r))²`` from ``g2 = Σ_r g_r ∘ g_r`` (the output gradients' squares,
        summed over the vectors ``r``), for a :meth:`separable` call."""
        raise NotImplementedError


def _stock(module: nn.Module, cls: type[nn.Module]) -> bool:
    return isinstance(module, cls) and type(module).forward is cls.forward


def _param(call: Call, role: str) -> Tensor:
    """The module's parameter ``role`` (``"weight"``/``"bias"``)."""
    param = getattr(call.module, role)
    assert isinstance(param, Tensor)
    return param


class _LinearLike(Rule):
    """Layers ``y_s = W a_s + b`` shared over positions ``s``: per example ``Σ_s g_s a_sᵀ``."""

    def operands(
        self, call: Call, g: Tensor, lo: int, hi: int, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """``A`` of shape ``(b, S, in)`` and ``G`` of shape ``(b, S, out)`` for examples lo:hi."""
        raise NotImplementedError

    def product(self, a: Tensor, g: Tensor, module: nn.Module) -> Tensor:
        """``Σ_s g_s a_sᵀ`` per example (``(b, S, ·)`` operands, batched matmul) or ``Σ_i g_i a_iᵀ``
        (2-D operands), written straight into the layout of the module's weight (contiguous)."""
        return g.mT @ a

    def shares_weight(self, call: Call) -> bool:
        """Whether an example has several positions (then its gradient is a sum over them)."""
        assert call.inputs is not None
        return call.inputs[0].numel() != call.inputs.shape[-1]

    def per_example(
        self, call: Call, g: Tensor, role: str, lo: int, hi: int, dtype: torch.dtype
    ) -> Tensor:
        if role == "bias":
            return g[lo:hi].to(dtype).reshape(hi - lo, -1, g.shape[-1]).sum(1)
        a, gg = self.operands(call, g, lo, hi, dtype)
        return self.product(a, gg, call.module)

    def per_example_into(
        self, call: Call, g: Tensor, role: str, lo: int, hi: int, out: Tensor, add: bool
    ) -> None:
        """The weight's per-example gradients as ONE batched product written into ``out``
        (``baddbmm`` with β = 0 or 1: no temporary of the parameter's size per example)."""
        if role == "bias":
            super().per_example_into(call, g, role, lo, hi, out, add)
            return
        a, gg = self.operands(call, g, lo, hi, out.dtype)
        left, right = self.factors(a, gg)
        target = out.view(hi - lo, left.shape[1], right.shape[2])
        torch.baddbmm(target, left, right, beta=1 if add else 0, out=target)

    def factors(self, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """The operands of :meth:`product` as a batched product ``left @ right``."""
        return g.mT, a

    def sq_sum(self, call: Call, g: Tensor, role: str, dtype: torch.dtype) -> Tensor:
        if role == "weight" and not self.shares_weight(call):
            return self.sq_sum_of_squares(call, g.to(dtype).square(), role, dtype)
        return super().sq_sum(call, g, role, dtype)

    def separable(self, call: Call) -> bool:
        return not self.shares_weight(call)

    def sq_sum_of_squares(self, call: Call, g2: Tensor, role: str, dtype: torch.dtype) -> Tensor:
        """One position per example: ``∇_W ℓ_i = g_i a_iᵀ``, so ``Σ_i Σ_r (g_ir a_iᵀ)²`` is
        ``Σ_i g2_i (a_i²)ᵀ`` — one matmul, ``(g2)ᵀ (a²)`` — and the bias' is ``Σ_i g2_i``."""
        if role == "bias":
            return g2.to(dtype).reshape(-1, g2.shape[-1]).sum(0)
        a, gg = self.operands(call, g2, 0, g2.shape[0], dtype)
        return self.product(a[:, 0, :].square(), gg[:, 0, :], call.module)


class LinearRule(_LinearLike):
    """``nn.Linear`` on inputs ``(B, ..., in)``; the middle dims are positions."""

    def applies(self, module: nn.Module) -> bool:
        return _stock(module, nn.Linear)

    def operands(
        self, call: Call, g: Tensor, lo: int, hi: int, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        assert call.inputs is not None
        a = call.inputs[lo:hi].to(dtype)
        return a.reshape(hi - lo, -1, a.shape[-1]), g[lo:hi].to(dtype).reshape(
            hi - lo, -1, g.shape[-1]
        )


class Conv1DRule(LinearRule):
    """transformers' GPT-2 ``Conv1D``: ``y = a W + b`` with ``W`` of shape ``(in, out)``."""

    def applies(self, module: nn.Module) -> bool:
        # A Conv1D instance implies that transformers is imported: look it up rather than import
        # it (importing transformers costs seconds and ~16 MB for models that do not use it).
        utils = sys.modules.get("transformers.pytorch_utils")
        conv1d = getattr(utils, "Conv1D", None)
        return isinstance(conv1d, type) and _stock(module, conv1d)

    def product(self, a: Tensor, g: Tensor, module: nn.Module) -> Tensor:
        return a.mT @ g

    def factors(self, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        return a.mT, g


class Conv2dRule(_LinearLike):
    """``nn.Conv2d`` (groups 1, zero padding): unfolded patches are the inputs, pixels the
    positions."""

    def applies(self, module: nn.Module) -> bool:
        return (
            _stock(module, nn.Conv2d)
            and bool(module.groups == 1)
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        )

    def batch_ok(self, inputs: Tensor, output: Tensor, batch: int) -> bool:
        return inputs.ndim == 4 and super().batch_ok(inputs, output, batch)

    def shares_weight(self, call: Call) -> bool:
        return True  # pixels are positions (a 1×1 output is rare enough to take this path too)

    def operands(
        self, call: Call, g: Tensor, lo: int, hi: int, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        m = call.module
        assert call.inputs is not None and isinstance(m, nn.Conv2d)
        patches = nn.functional.unfold(
            call.inputs[lo:hi].to(dtype), m.kernel_size, m.dilation, cast(Any, m.padding), m.stride
        )
        return patches.transpose(1, 2), g[lo:hi].to(dtype).flatten(2).transpose(1, 2)

    def product(self, a: Tensor, g: Tensor, module: nn.Module) -> Tensor:
        assert isinstance(module, nn.Conv2d)
        return (g.mT @ a).reshape(a.shape[0], *module.weight.shape)

    def per_example(
        self, call: Call, g: Tensor, role: str, lo: int, hi: int, dtype: torch.dtype
    ) -> Tensor:
        if role == "bias":
            return g[lo:hi].to(dtype).sum((2, 3))
        return super().per_example(call, g, role, lo, hi, dtype)


class EmbeddingRule(Rule):
    """``nn.Embedding``: example ``i``'s gradient is ``Σ_s e_{x_is} g_isᵀ`` (rows summed first).

    Rows at ``padding_idx`` get no gradient. ``sparse`` and ``scale_grad_by_freq`` (which couples
    the examples of a batch) are left to the fallback.
    """

    broadcasts_batch = True
    sparse_rows = True

    def applies(self, module: nn.Module) -> bool:
        return (
            _stock(module, nn.Embedding)
            and not bool(module.sparse)
            and not bool(module.scale_grad_by_freq)
        )

    def batch_ok(self, inputs: Tensor, output: Tensor, batch: int) -> bool:
        return inputs.ndim >= 1 and inputs.shape[0] == batch and output.shape[0] == batch

    def _rows(
        self, call: Call, g: Tensor, lo: int, hi: int, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """Row keys ``(i − lo)·V + x_is`` and gradients ``g_is`` of the positions that count."""
        m = call.module
        assert call.inputs is not None and isinstance(m, nn.Embedding)
        idx = call.inputs[lo:hi].reshape(hi - lo, -1)
        offsets = torch.arange(hi - lo, device=idx.device).unsqueeze(1) * m.num_embeddings
        keys, grads = (idx + offsets).reshape(-1), g[lo:hi].reshape(-1, g.shape[-1]).to(dtype)
        if m.padding_idx is not None:
            keep = idx.reshape(-1) != m.padding_idx
            keys, grads = keys[keep], grads[keep]
        return keys, grads

    def per_example(
        self, call: Call, g: Tensor, role: str, lo: int, hi: int, dtype: torch.dtype
    ) -> Tensor:
        weight = _param(call, "weight")
        keys, grads = self._rows(call, g, lo, hi, dtype)
        out = torch.zeros(
            (hi - lo) * weight.shape[0], weight.shape[1], dtype=dtype, device=g.device
        )
        return out.index_add_(0, keys, grads).reshape(hi - lo, *weight.shape)

    def per_example_into(
        self, call: Call, g: Tensor, role: str, lo: int, hi: int, out: Tensor, add: bool
    ) -> None:
        """The rows of the example's tokens added in place (``index_add_``); the other rows of
        ``out`` are zeroed only when it is not added to."""
        keys, grads = self._rows(call, g, lo, hi, out.dtype)
        if not add:
            out.zero_()
        out.view(-1, out.shape[-1]).index_add_(0, keys, grads)

    def sq_sum(self, call: Call, g: Tensor, role: str, dtype: torch.dtype) -> Tensor:
        weight = _param(call, "weight")
        keys, grads = self._rows(call, g, 0, g.shape[0], dtype)
        unique, inverse = torch.unique(keys, return_inverse=True)
        per_row = torch.zeros(unique.numel(), weight.shape[1], dtype=dtype, device=g.device)
        per_row.index_add_(0, inverse, grads)  # Σ_s over repeats of a token within an example
        out = torch.zeros(weight.shape, dtype=dtype, device=g.device)
        return out.index_add_(0, unique % weight.shape[0], per_row.square_())


class LayerNormRule(Rule):
    """``nn.LayerNorm``: per example ``Σ_s g_s ∘ x̂_s`` (weight) and ``Σ_s g_s`` (bias)."""

    def applies(self, module: nn.Module) -> bool:
        return _stock(module, nn.LayerNorm) and bool(module.elementwise_affine)

    def per_example(
        self, call: Call, g: Tensor, role: str, lo: int, hi: int, dtype: torch.dtype
    ) -> Tensor:
        m = call.module
        assert call.inputs is not None and isinstance(m, nn.LayerNorm)
        shape = m.normalized_shape
        gg = g[lo:hi].to(dtype).reshape(hi - lo, -1, *shape)
        if role == "bias":
            return gg.sum(1)
        a = call.inputs[lo:hi].to(dtype)
        return (gg * self._normalized(call, a).reshape(gg.shape)).sum(1)

    @staticmethod
    def _normalized(call: Call, a: Tensor) -> Tensor:
        """x̂ = (a − mean) / √(var + eps) over the normalised dims (the module's own kernel,
        without the affine part: one pass)."""
        m = call.module
        assert isinstance(m, nn.LayerNorm)
        return nn.functional.layer_norm(a, m.normalized_shape, eps=m.eps)

    def separable(self, call: Call) -> bool:
        m = call.module
        assert call.inputs is not None and isinstance(m, nn.LayerNorm)
        return call.inputs[0].numel() == m.weight.numel()  # one position per example

    def sq_sum_of_squares(self, call: Call, g2: Tensor, role: str, dtype: torch.dtype) -> Tensor:
        """One position: ``Σ_i Σ_r (g_ir ∘ x̂_i)² = Σ_i g2_i ∘ x̂_i²``; the bias' is
        ``Σ_i g2_i``."""
        m = call.module
        assert call.inputs is not None and isinstance(m, nn.LayerNorm)
        g2 = g2.to(dtype).reshape(-1, *m.normalized_shape)
        if role == "bias":
            return g2.sum(0)
        x_hat = self._normalized(call, call.inputs.to(dtype)).reshape(g2.shape)
        return (g2 * x_hat.square_()).sum(0)


RULES: tuple[Rule, ...] = (
    LinearRule(),
    Conv1DRule(),
    Conv2dRule(),
    EmbeddingRule(),
    LayerNormRule(),
)


def rule_for(module: nn.Module) -> Rule | None:
    """The rule covering ``module``'s own parameters, or ``None``."""
    return next((rule for rule in RULES if rule.applies(module)), None)


class Recorder:
    """Forward hooks that record the :class:`Call` s of the given modules while ``batch`` is set.

    A module called with a batch-1 input while the batch has ``B > 1`` examples (a position
    embedding looked up with ``position_ids`` of shape ``(1, S)``, as in GPT-2) has its output
    expanded to ``B`` rows when its rule allows it: the value is unchanged under the broadcast that
    follows, and its gradient becomes per example.
    """

    def __init__(self, modules: dict[nn.Module, Rule]) -> None:
        self.calls: list[Call] = []
        self.batch: int | None = None
        self._rules = modules
        self._handles: list[RemovableHandle] = [
            m.register_forward_hook(self._hook, with_kwargs=True) for m in modules
        ]

    def _hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Tensor | None:
        if self.batch is None or not isinstance(output, Tensor) or not output.requires_grad:
            return None
        rule = self._rules[module]
        x = args[0] if args else next(iter(kwargs.values()), None)
        x = x.detach() if isinstance(x, Tensor) else None
        expand = (
            rule.broadcasts_batch and x is not None and x.ndim >= 1 and self.batch > 1
            and x.shape[0] == 1 and output.shape[0] == 1
        )  # fmt: skip
        if expand:
            assert x is not None
            x = x.expand(self.batch, *x.shape[1:])
            output = output.expand(self.batch, *output.shape[1:])
        self.calls.append(Call(module, rule, x, output, output._version))
        return output if expand else None

    def take(self) -> list[Call]:
        calls, self.calls = self.calls, []
        return calls

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def param_edge_counts(root: Tensor, names: dict[int, str]) -> Counter[str]:
    """How many autograd-graph edges lead from ``root`` into each named parameter.

    Every functional use of a parameter (one ``F.linear``, one ``F.embedding``, ...) adds one
    edge into its gradient accumulator. A parameter whose edge count differs from its number of
    recorded calls is used somewhere the hooks do not see (a subclass, ``x * self.scale``, a
    second path), so the estimator cannot build its per-example gradient from the calls alone.
    """
    counts: Counter[str] = Counter()
    if root.grad_fn is None:
        return counts
    seen = {root.grad_fn}
    stack = [root.grad_fn]
    while stack:
        for node, _ in stack.pop().next_functions:
            if node is None:
                continue
            variable = getattr(node, "variable", None)
            if variable is not None:
                if id(variable) in names:
                    counts[names[id(variable)]] += 1
            elif node not in seen:
                seen.add(node)
                stack.append(node)
    return counts
