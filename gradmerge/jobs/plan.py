"""The plan of a streaming merge: which tensors are processed together, in which order.

A *unit* is the smallest set of parameters that must be merged together: one tensor under a
diagonal curvature (or none), a K-FAC layer's weight and bias, the parameters of a dense block
(a :class:`gm.Dense` curvature couples everything it covers, so a dense curvature over a whole
model makes the whole model one unit), the union of what the curvatures of all inputs couple.
Non-float tensors (buffers such as ``position_ids``) and ``passthrough`` tensors are copied from
the base, one per unit. Units follow the base's storage order, so inputs are read sequentially.

*Untouched* units are copied from the base too, by every method: a coupling group where every
model's task vector θ_t − θ_LLM is exactly zero. Where that is known from the inputs' headers —
a LoRA adapter changes only its target weights and ``modules_to_save``
(:attr:`gradmerge.io.lora.LoraCheckpoint.changed`) — the plan copies the group and no curvature
is needed for it (an adapter's curvature, estimated over what it changes, covers none of it). A
group that only a curvature file *restricted* to an adapter's parameters
(``C.meta["restricted"] == "adapter"``, written by ``gradmerge curvature``) leaves uncovered,
with models whose task vectors are not known from headers (full checkpoints), is copied after
checking, as it is read, that every model equals the base there (:attr:`Plan.checked`). Any
other group is merged; the engine still copies a merged unit whose task vectors all read as
exactly zero (:class:`gradmerge.jobs.job.Job`), before any solve.

Why copying is exact: where every τ_t = 0 on a group g that no curvature couples to another
group, Eq. 6's right-hand side Σ_t α_t (H_0 + H_t) τ_t is zero on g, H̄ is block diagonal
across g, so θ_g = θ_LLM,g + H̄_gg⁻¹·0 = θ_LLM,g for any H̄_gg that is positive definite
(whatever the curvatures there are, a missing one included); where H̄_gg is singular Eq. 6 has
no unique value and θ_LLM,g is its minimum-norm one (the limit δ → 0 of a δ·I prior). Task
arithmetic (H_t = 0), Fisher averaging and RegMean (every θ_t = θ_LLM: an average of equal
values) and TSV-M, Iso-C and Iso-CTS (θ_LLM + a function of the τ_t that is zero at zero) give
θ_LLM,g as well.

Everything here is decided from the files' headers and curvature metadata: a plan reads no
tensor, and every mismatch between inputs is reported before any output is written.
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from gradmerge.curvature.io import CurvatureFile
from gradmerge.curvature.spec import join_groups
from gradmerge.errors import ConfigError, DTypeError, InputWarning, StructureError
from gradmerge.foundation.text import first_and_more
from gradmerge.io.reader import Checkpoint
from gradmerge.methods.base import Coverage


@dataclass(frozen=True)
class Unit:
    """Tensors processed together: a coupling group (``merged``), one tensor copied from the base,
    or an ``untouched`` group copied from the base because no model changes it."""

    keys: tuple[str, ...]
    merged: bool
    untouched: bool = False


@dataclass(frozen=True)
class Plan:
    """The units of a run, in order, and the name, shape and output dtype of every tensor."""

    units: tuple[Unit, ...]
    shapes: dict[str, tuple[int, ...]]
    out_dtypes: dict[str, torch.dtype]
    checked: frozenset[str] = frozenset()
    """Untouched tensors to check as they are read: every model must equal the base there (a
    curvature restricted to an adapter's parameters leaves them out)."""

    @property
    def untouched(self) -> list[str]:
        """Names of the tensors copied from the base because no model changes them."""
        return [k for u in self.units if u.untouched for k in u.keys]

    @property
    def merged(self) -> list[str]:
        """Names of the tensors that are merged."""
        return [k for u in self.units if u.merged for k in u.keys]

    @property
    def copied(self) -> list[str]:
        """Names of the tensors copied from the base (non-float, passthrough and untouched
        tensors)."""
        return [k for u in self.units if not u.merged for k in u.keys]

    @property
    def largest_unit(self) -> Unit:
        """The unit with the most scalars: what bounds the memory of a run."""
        return max(self.units, key=lambda u: sum(math.prod(self.shapes[k]) for k in u.keys))

    def out_bytes(self) -> int:
        """The size of the output's tensor data."""
        return sum(math.prod(s) * self.out_dtypes[k].itemsize for k, s in self.shapes.items())


def build_plan(
    base: Checkpoint,
    models: Sequence[tuple[str, Checkpoint]],
    curvatures: Sequence[tuple[str, CurvatureFile]],
    *,
    coverage: Coverage,
    passthrough: Sequence[str] = (),
    out_dtype: torch.dtype | None = None,
    allow_mixed_dtypes: bool = False,
    gradient: tuple[str, Checkpoint] | None = None,
    untouched: Collection[str] = (),
    touched: Collection[str] = (),
    copy_untouched: bool = True,
) -> Plan:
    """Check that the inputs fit together and group the tensors into units.

    Args:
        base: θ_LLM; its float tensors are merged, its other tensors copied.
        models: (role, checkpoint) of the other models, which must hold exactly the base's
            tensors, with the same shapes and dtypes.
        curvatures: (role, file) of every curvature used (tasks, prior, remaining).
        coverage: what the curvatures must cover (see :data:`gradmerge.methods.base.Coverage`).
        passthrough: globs of float tensors copied from the base instead of merged.
        out_dtype: the output dtype of float tensors (``None``: the base's).
        allow_mixed_dtypes: accept float tensors whose dtype differs between inputs.
        gradient: (role, checkpoint) of a gradient file, which must hold every merged tensor.
        untouched: tensors every model is known (from its header: a LoRA adapter) to leave at
            the base; a coupling group of them only is copied, and needs no curvature.
        touched: tensors some model is known to change (an adapter's targets and saved
            modules); every other tensor is unknown until read (full checkpoints).
        copy_untouched: copy a group that curvatures restricted to adapters leave out, checking
            it as it is read (a merge); ``False``: refuse it, as any uncovered tensor (a removal).

    Raises:
        StructureError: missing or extra tensors, other shapes, curvatures that do not cover a
            merged tensor (one some model changes, or may change) or that couple it with a
            passthrough tensor (each names the tensor).
        DTypeError: a tensor whose dtype differs between inputs.
        ConfigError: a passthrough glob that matches no tensor.

    Warns:
        InputWarning: ``passthrough`` covers every floating-point tensor (nothing is merged).
    """
    keys = base.keys()
    role = f"base_model ({base.path})"
    for name, ckpt in models:
        _check_same_tensors(base, role, ckpt, f"{name} ({ckpt.path})", allow_mixed_dtypes)
    floating = [k for k in keys if base.dtype(k).is_floating_point]
    copied = matching(keys, passthrough, key="passthrough")
    merged = [k for k in floating if k not in copied]
    if floating and not merged:
        warnings.warn(
            InputWarning(
                f"passthrough {list(passthrough)} covers every floating-point tensor of the base "
                "model: nothing is merged, and the output is the base model unchanged; list only "
                "the tensors to copy (e.g. 'classifier.*')"
            ),
            stacklevel=2,
        )
    if gradient is not None:
        _check_gradient(base, merged, *gradient)

    shapes = {k: base.shape(k) for k in keys}
    merged_set = set(merged)
    groups: list[tuple[str, ...]] = [(k,) for k in merged]
    layouts: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, cf in curvatures:
        layout = dict(cf.layout)
        for k, s in layout.items():
            if k not in shapes:
                raise StructureError(
                    f"{name} ({cf.path}) covers {k!r}, which the base model does not have: it "
                    "was estimated for another model"
                )
            if tuple(s) != shapes[k]:
                raise StructureError(
                    f"{name} ({cf.path}) has shape {tuple(s)} for {k!r} but the base has "
                    f"{shapes[k]}: it was estimated for another model"
                )
            if k not in copied and k not in merged_set:
                raise DTypeError(
                    f"{name} ({cf.path}) covers {k!r}, which is {base.dtype(k)} in the base: "
                    "only floating-point tensors are merged"
                )
        layouts[name] = {k: tuple(s) for k, s in layout.items()}
        coupled = list(cf.kfac_layers().values()) if coverage == "kfac" else cf.couplings()
        for group in coupled:
            inside = [k for k in group if k in merged_set]
            if inside and len(inside) != len(group):
                outside = [k for k in group if k not in merged_set]
                raise StructureError(
                    f"{name} ({cf.path}) couples {inside[0]!r} with {outside[0]!r}, which is "
                    "passed through: a coupled group is merged whole; pass all of it through or "
                    "none of it"
                )
            if inside:
                groups.append(tuple(inside))
    if coverage == "kfac":
        _check_same_layers(curvatures)

    known_untouched, known_touched = set(untouched), set(touched)
    checked: set[str] = set()
    kinds: dict[str, str] = {}  # the first key of a group → "merged", "untouched"
    refused: dict[str, list[str]] = {}  # a curvature's name → the merged tensors it lacks
    files = dict(curvatures)
    joined = join_groups(groups)
    for group in joined:
        if all(k in known_untouched for k in group):
            kinds[group[0]] = "untouched"
            continue
        kinds[group[0]] = "merged"
        lacking = (
            [(name, cf, k) for name, cf in curvatures for k in group if k not in layouts[name]]
            if coverage == "all"
            else []
        )
        if not lacking:
            continue
        needed = [
            (n, k)
            for n, f, k in lacking
            if f.info.get("restricted") != "adapter"
            or not copy_untouched
            or k in known_untouched
            or any(g in known_touched for g in group)
        ]
        if not needed:  # left out by curvatures restricted to adapters; models not known
            kinds[group[0]] = "untouched"
            checked.update(group)
            continue
        for n, k in needed:
            refused.setdefault(n, []).append(k)
    if refused:
        name, missing = next(iter(refused.items()))
        cf = files[name]
        if cf.info.get("restricted") == "adapter":
            raise StructureError(
                f"{name} ({cf.path}) was estimated over the parameters its LoRA adapter changes "
                f"only, and has no curvature for {first_and_more(missing, 'tensor(s)')}, which "
                "another model changes (or which a curvature couples with what it changes): "
                "every model's curvature must cover what any model changes. Estimate it again "
                "with `gradmerge curvature ... --whole-model`, or merge adapters of the same "
                "target modules"
            )
        raise StructureError(
            f"{name} ({cf.path}) has no curvature for "
            f"{first_and_more(missing, 'tensor(s)')}. Estimate the curvature over every "
            "parameter (structure='kfac' adds a diagonal block for what K-FAC does not "
            "cover), or list the tensor under `passthrough:` to copy it from the base "
            "unmerged."
        )

    position = {k: i for i, k in enumerate(keys)}
    units: list[Unit] = []
    first_of = {g[0]: g for g in joined}
    for k in keys:
        if k in first_of:
            ordered = tuple(sorted(first_of[k], key=position.__getitem__))
            if kinds[k] == "untouched":
                units.append(Unit(ordered, False, untouched=True))
            else:
                units.append(Unit(ordered, True))
        elif k not in merged_set:
            units.append(Unit((k,), False))
    out_dtypes = {
        k: (out_dtype or base.dtype(k)) if base.dtype(k).is_floating_point else base.dtype(k)
        for k in keys
    }
    return Plan(tuple(units), shapes, out_dtypes, frozenset(checked))


def _check_same_tensors(
    base: Checkpoint, role: str, other: Checkpoint, name: str, allow_mixed: bool
) -> None:
    mine, theirs = set(base.keys()), set(other.keys())
    if mine != theirs:
        missing = sorted(mine - theirs)
        extra = sorted(theirs - mine)
        parts = []
        if missing:
            parts.append(f"lacks {len(missing)} tensor(s) of the base, e.g. {missing[:3]}")
        if extra:
            parts.append(f"has {len(extra)} tensor(s) the base lacks, e.g. {extra[:3]}")
        raise StructureError(
            f"{name} does not match {role}: it {'; it '.join(parts)}. Every model must hold the "
            "same tensors: fine-tunes of one base model, saved the same way."
        )
    for k in base:
        if other.shape(k) != base.shape(k):
            raise StructureError(
                f"{name} has shape {other.shape(k)} for {k!r} but the base has {base.shape(k)}: "
                "the models do not share an architecture"
            )
        a, b = base.dtype(k), other.dtype(k)
        if a != b and not (allow_mixed and a.is_floating_point and b.is_floating_point):
            hint = (
                " (set `allow_mixed_dtypes: true` to merge float tensors of different dtypes)"
                if a.is_floating_point and b.is_floating_point
                else ""
            )
            raise DTypeError(f"{name} stores {k!r} as {b} but the base as {a}{hint}")


def _check_gradient(base: Checkpoint, merged: list[str], name: str, grad: Checkpoint) -> None:
    role = f"{name} ({grad.path})"
    missing = [k for k in merged if k not in grad]
    if missing:
        raise StructureError(
            f"{role} has no gradient for {first_and_more(missing, 'tensor(s)')}: it must hold "
            "∇ℓ̄_t(θ_LLM) for every merged parameter, under the parameter's name (or list the "
            "tensor under `passthrough:`)"
        )
    for k in grad:
        if k not in base:
            raise StructureError(f"{role} holds {k!r}, which the base model does not have")
        if grad.shape(k) != base.shape(k):
            raise StructureError(
                f"{role} has shape {grad.shape(k)} for {k!r} but the base has {base.shape(k)}"
            )
        if not grad.dtype(k).is_floating_point:
            raise DTypeError(f"{role} stores {k!r} as {grad.dtype(k)}: a gradient is float")


def _check_same_layers(curvatures: Sequence[tuple[str, CurvatureFile]]) -> None:
    if not curvatures:
        return
    first_name, first = curvatures[0]
    layers = first.kfac_layers()
    if not layers:
        raise StructureError(
            f"{first_name} ({first.path}) holds no K-FAC layers: RegMean takes its Gram matrices "
            "from K-FAC input factors; estimate the curvature with structure='kfac'"
        )
    for name, cf in curvatures[1:]:
        other = cf.kfac_layers()
        if other != layers:
            diff = sorted(set(layers) ^ set(other)) or sorted(
                n for n in layers if layers[n] != other[n]
            )
            raise StructureError(
                f"{name} ({cf.path}) has K-FAC factors for other layers than {first_name}, e.g. "
                f"{diff[:3]}: RegMean needs every model's Grams for the same layers"
            )


def matching(keys: Sequence[str], patterns: Sequence[str], *, key: str) -> set[str]:
    """The ``keys`` that some name or glob (``fnmatch``) of ``patterns`` matches.

    Raises:
        ConfigError: a pattern that matches no key (``key``: the YAML key that lists them).
    """
    chosen: set[str] = set()
    for pattern in patterns:
        hits = [k for k in keys if fnmatch.fnmatchcase(k, pattern)]
        if not hits:
            raise ConfigError(
                f"{key} pattern {pattern!r} matches no tensor of the base model; "
                f"its tensors are named like {list(keys[:3])}"
            )
        chosen.update(hits)
    return chosen
