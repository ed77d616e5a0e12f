"""The layers K-FAC covers and the running sums of their factors, call by call.

Which modules get Kronecker factors (:func:`select_layers`: supported, trainable, not sharing
their weight, factor sides within the limit), which positions of a batch count (:class:`Masks`),
how a call's inputs and output gradients become rows of A's and G's Gram sums (:func:`add_inputs`,
:func:`add_grads`, in the layout of :mod:`gradmerge.estimate.kfac`'s docstring), and the factors
(A, G) those sums end as (:func:`finished_factors`). The passes that feed them are
:mod:`gradmerge.estimate._kfac_pass`.

Example:
    >>> import torch
    >>> from gradmerge.estimate._kfac_layers import select_layers
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    >>> {n: (layer.kind, layer.bias) for n, layer in select_layers(model, None, None, {}).items()}
    {'0': ('linear', True)}
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from gradmerge.errors import ArgumentError, NonFiniteError, StructureError
from gradmerge.estimate._data import Inputs, Loss, accumulation_dtype, num_examples
from gradmerge.estimate._gram import (
    GRAM_BUFFER_BYTES,
    Budget,
    GramSum,
    add_augmented_gram,
    symmetrize_,
)
from gradmerge.estimate.options import KFACApprox

LayerKind = Literal["linear", "conv2d", "conv1d", "embedding"]

SUPPORTED_LAYERS = (
    "nn.Linear, nn.Conv2d (groups=1, zero padding), nn.Embedding, transformers Conv1D"
)


@dataclass
class Layer:
    """One covered module and the running sums of its factors."""

    module: nn.Module
    weight: Tensor
    kind: LayerKind
    bias: bool
    a_sum: Tensor  # (in + bias)² running sum, upper triangle; (vocab,) counts for embeddings
    a_gram: GramSum | None  # the products into a_sum (None for embeddings)
    g_gram: GramSum  # its ``acc`` is the (out, out) running sum of G, upper triangle
    count: int = 0
    calls: int = 0


def layer_kind(module: nn.Module) -> LayerKind | None:
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


def select_layers(
    model: nn.Module,
    modules: Sequence[str] | None,
    kfac_max_factor_side: int | None,
    left_out: dict[str, str],
) -> dict[str, Layer]:
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
        unsupported = [
            f"{m} ({type(named[m]).__name__})" for m in modules if not layer_kind(named[m])
        ]
        if unsupported:
            raise ArgumentError(
                f"modules {unsupported} are not K-FAC layers; supported: {SUPPORTED_LAYERS}"
            )
    candidates = {
        n: m for n, m in named.items() if layer_kind(m) and (modules is None or n in modules)
    }
    if not candidates:
        raise StructureError(f"the model has no K-FAC layer: looked for {SUPPORTED_LAYERS}")
    weight_users: dict[int, list[str]] = {}
    for n, m in named.items():
        if isinstance(getattr(m, "weight", None), Tensor):
            weight_users.setdefault(id(m.weight), []).append(n)
    layers, too_large, budget = {}, [], Budget(GRAM_BUFFER_BYTES)
    for name, module in candidates.items():
        weight = _weight(module)
        if not weight.requires_grad:
            continue
        others = [n for n in weight_users[id(weight)] if n != name]
        if others:
            left_out[name] = f"its weight is shared with {others} (tied)"
            continue
        kind = layer_kind(module)
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
        layers[name] = Layer(
            module,
            weight,
            kind,
            has_bias,
            a_sum,
            None if kind == "embedding" else GramSum(a_sum, budget),
            GramSum(torch.zeros(n_out, n_out, device=device, dtype=dtype), budget),
        )
    if too_large:
        warnings.warn(
            f"K-FAC gives no Kronecker factors to {', '.join(too_large)}: a factor side above "
            f"the limit of {kfac_max_factor_side}; a diagonal block covers their parameters. To "
            "keep them on K-FAC, raise the limit (--kfac-max-factor-side N, 'none' for no limit; "
            "in Python, kfac_max_factor_side).",
            stacklevel=3,
        )
    return layers


@dataclass(frozen=True)
class Masks:
    """Which positions of a batch are kept (:mod:`gradmerge.estimate.kfac`'s docstring), by the
    shape of a layer's positions."""

    targets: Tensor  # (B, *T) bool, or (B,) for losses without positions
    attention: Tensor | None  # (B, S) bool
    everything: bool  # every example has positions and all are kept: no layer needs a mask

    @classmethod
    def of_batch(cls, inputs: Inputs, targets: Tensor, loss: Loss) -> Masks:
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


def layer_inputs(layer: Layer, x: Tensor, out: Tensor) -> tuple[torch.Size, Tensor]:
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


def layer_grads(layer: Layer, g: Tensor) -> Tensor:
    """Output gradients as (B, P, out)."""
    if layer.kind == "conv2d":
        return g.flatten(2).transpose(1, 2)
    return g.reshape(g.shape[0], -1, g.shape[-1])


def _all_finite(t: Tensor) -> bool:
    """Whether every entry is finite (a NaN/Inf entry makes the sum NaN/Inf: one reduction)."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def add_inputs(layer: Layer, a: Tensor, keep: Tensor | None, approx: KFACApprox) -> None:
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
    add_augmented_gram(layer.a_gram, rows, layer.bias)


def add_grads(
    layer: Layer, g: Tensor, keep: Tensor | None, approx: KFACApprox, weight: float
) -> None:
    """Add ``weight`` · Σ g gᵀ of one call's output gradients to G."""
    g = layer_grads(layer, g).to(layer.g_gram.acc.dtype)
    if approx == "expand" or layer.kind == "embedding":
        rows = g.reshape(-1, g.shape[-1]) if keep is None else g[keep]
    elif keep is None:
        rows = g.sum(dim=1)
    else:
        rows = (g * keep.to(g.dtype).unsqueeze(-1)).sum(dim=1)
    layer.g_gram.add(rows, weight)


def uncovered_params(model: nn.Module, layers: dict[str, Layer]) -> list[str]:
    covered = set()
    for layer in layers.values():
        covered.add(id(layer.weight))
        if layer.bias:
            covered.add(id(layer.module.bias))
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]


def finished_factors(layers: dict[str, Layer]) -> dict[str, tuple[Tensor, Tensor]]:
    """(A, G) of every layer, from its running sums (which it takes over and modifies)."""
    factors = {}
    for name, layer in layers.items():
        a = layer.a_sum
        if layer.a_gram is not None:  # every kind but embeddings
            layer.a_gram.flush()
            if layer.bias:  # the corner of the augmented Gram matrix (add_augmented_gram)
                a[-1, -1] += layer.count
            a = symmetrize_(a)
        a = a.div_(max(layer.count, 1))
        padding_idx = getattr(layer.module, "padding_idx", None)
        if layer.kind == "embedding" and padding_idx is not None:
            a[padding_idx] = 0
        layer.g_gram.flush()
        g = symmetrize_(layer.g_gram.acc)
        if not (_all_finite(a) and _all_finite(g)):
            raise NonFiniteError(
                f"the K-FAC factors of {name!r} are NaN/Inf although every loss "
                "was finite: check the model for overflow (e.g. fp16)"
            )
        factors[name] = (a, g)
    return factors
