r"""What every rank must agree on before estimating: the model, compared by a cheap fingerprint.

A data-parallel estimate sums the ranks' curvatures, so every rank must hold the SAME model: a
rank that loaded another checkpoint (or a stale one) would silently add the curvature of another
network. :func:`model_fingerprint` summarises a model without moving its weights: per parameter
and buffer its name, shape, dtype, ``requires_grad`` and two integer checksums of its bits,

    s₁ = Σ_i b_i   and   s₂ = Σ_i b_i · (K·i + 1)      (mod 2⁶⁴),

where b_i is element i's bit pattern read as a signed integer of the element's width and K an odd
64-bit constant. Integer sums are exact and independent of the summation order, so equal tensors
give equal checksums on any device and thread count; s₂ also changes when elements are permuted.
The names of the modules left in training mode are part of the fingerprint too (dropout makes an
estimate random).

:func:`unwrap` strips a ``DistributedDataParallel``/``DataParallel`` wrapper (its ``.module``
holds the full, replicated parameters; running the inner module never triggers DDP's gradient
all-reduce). FSDP (``FullyShardedDataParallel``, ``fully_shard``) and any ``DTensor`` parameter
(tensor parallelism) are refused: each rank holds only a shard of each weight, while per-example
gradients and K-FAC factors are computed per layer from the full weight.

Example:
    >>> import torch
    >>> from gradmerge.distributed.fingerprint import model_fingerprint, first_difference
    >>> a = torch.nn.Linear(2, 2)
    >>> b = torch.nn.Linear(2, 2)
    >>> first_difference(model_fingerprint(a), model_fingerprint(a)) is None
    True
    >>> first_difference(model_fingerprint(a), model_fingerprint(b))[:40]
    "the values of 'weight' and 1 more differ"
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gradmerge.errors import ArgumentError
from gradmerge.foundation.text import first_and_more, key_list

_K = 0x5851F42D4C957F2D  # odd; a 64-bit LCG multiplier (Knuth, MMIX)
_CHUNK = 1 << 22  # elements per checksum step (bounds the int64 temporaries: 32 MB each)
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

FSDP_HELP = (
    "FSDP and DTensor (tensor-parallel) parameters are sharded: each rank holds a piece of every "
    "weight, but per-example gradients and K-FAC factors need each layer's full weight. Gather a "
    "full copy on every rank and pass that instead, e.g. "
    "sd = torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
    "options=StateDictOptions(full_state_dict=True, cpu_offload=True)); "
    "plain_model.load_state_dict(sd)"
)


@dataclass(frozen=True)
class Entry:
    """One parameter or buffer: what it is and two checksums of its bits (module docstring)."""

    kind: str  # "parameter" or "buffer"
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    checksums: tuple[int, int]


@dataclass(frozen=True)
class ModelFingerprint:
    """A model's parameters and buffers (name → :class:`Entry`) and its modules in training mode."""

    entries: dict[str, Entry]
    training: tuple[str, ...]


def unwrap(model: nn.Module) -> nn.Module:
    """The module to estimate on: ``model.module`` for DDP/DataParallel; refuses sharded models.

    Raises:
        ArgumentError: an FSDP-wrapped model or ``DTensor`` parameters (see ``FSDP_HELP``).
    """
    if not isinstance(model, nn.Module):
        raise ArgumentError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while isinstance(model, wrappers):
        model = model.module
    sharded = _sharded(model)
    if sharded:
        raise ArgumentError(f"the model is sharded ({sharded}). {FSDP_HELP}")
    return model


def _sharded(model: nn.Module) -> str | None:
    """A description of the first FSDP module or DTensor parameter, or None.

    FSDP and DTensor are looked up only when already imported (a model cannot use them otherwise;
    importing FSDP costs seconds).
    """
    fsdp, tensor = (
        sys.modules.get("torch.distributed.fsdp"),
        sys.modules.get("torch.distributed.tensor"),
    )
    wrappers = tuple(
        cls
        for cls in (
            getattr(fsdp, "FullyShardedDataParallel", None),
            getattr(fsdp, "FSDPModule", None),
        )
        if isinstance(cls, type)
    )
    dtensor = getattr(tensor, "DTensor", None)
    if wrappers:
        for name, module in model.named_modules():
            if isinstance(module, wrappers):
                return f"module {name or '<root>'!r} is a {type(module).__name__}"
    if isinstance(dtensor, type):
        for name, param in model.named_parameters():
            if isinstance(param, dtensor) or isinstance(getattr(param, "data", None), dtensor):
                return f"parameter {name!r} is a DTensor"
    return None


def checksums(t: Tensor) -> tuple[int, int]:
    """(s₁, s₂) of the bits of ``t`` (module docstring); exact, order-independent."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.element_size() not in _INTS:  # e.g. complex128: read byte by byte
        flat = flat.view(torch.uint8)
    bits = flat.view(_INTS[flat.element_size()])
    s1 = torch.zeros((), dtype=torch.int64, device=t.device)
    s2 = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        index = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=t.device)
        s1 += chunk.sum()
        s2 += (chunk * (index * _K + 1)).sum()
    return int(s1), int(s2)


def model_fingerprint(model: nn.Module) -> ModelFingerprint:
    """The fingerprint of ``model`` (parameters, buffers, training mode; module docstring)."""
    entries: dict[str, Entry] = {}
    tensors: list[tuple[str, str, Tensor]] = [
        *(("parameter", n, p) for n, p in model.named_parameters()),
        *(("buffer", n, b) for n, b in model.named_buffers()),
    ]
    for kind, name, t in tensors:
        entries[name] = Entry(
            kind,
            tuple(t.shape),
            str(t.dtype).removeprefix("torch."),
            bool(t.requires_grad),
            (0, 0) if t.is_meta else checksums(t),
        )
    training = tuple(n or "<root>" for n, m in model.named_modules() if m.training)
    return ModelFingerprint(entries, training)


def first_difference(reference: ModelFingerprint, other: ModelFingerprint) -> str | None:
    """How ``other`` differs from ``reference``, in words (the first few differences), or None."""
    ref, oth = reference.entries, other.entries
    missing = [k for k in ref if k not in oth]
    extra = [k for k in oth if k not in ref]
    if missing or extra:
        return (
            f"the parameter/buffer names differ (missing: {key_list(missing, 3)}, extra: "
            f"{key_list(extra, 3)})"
        )
    for what, attr in (
        ("shapes", "shape"),
        ("dtypes", "dtype"),
        ("requires_grad", "requires_grad"),
    ):
        diff = [k for k in ref if getattr(ref[k], attr) != getattr(oth[k], attr)]
        if diff:
            k = diff[0]
            first = f" for {k!r}" if len(diff) > 1 else ""
            return (
                f"the {what} of {first_and_more(diff)} differ ({getattr(oth[k], attr)} vs "
                f"{getattr(ref[k], attr)}{first})"
            )
    diff = [k for k in ref if ref[k].checksums != oth[k].checksums]
    if diff:
        return f"the values of {first_and_more(diff)} differ"
    if reference.training != other.training:
        return (
            f"different modules are in training mode ({key_list(list(other.training), 3)} vs "
            f"{key_list(list(reference.training), 3)}): call model.eval() on every rank"
        )
    return None
