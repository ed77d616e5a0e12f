"""Opening a job: its inputs, the checks that they fit together, its plan, and the function that
computes one unit (:func:`open_job`).

For every unit of the plan (:mod:`gradmerge.jobs.plan`: the smallest group of tensors some
curvature couples) the unit function reads that unit's tensors from every input — base,
fine-tuned models, the unit's part of each curvature file, the gradient — on the chosen device in
the compute dtype (``rows`` of its one tensor only, when given) and calls the method's pure rule
(:mod:`gradmerge.methods`). Before any tensor is read, a curvature file estimated at other
weights than its model's or the base's is judged (``curvature_weights``) and an Iso-CTS split
every matrix cannot take is refused.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import cast

import torch
from torch import Tensor

from gradmerge import params as P
from gradmerge.curvature import Blocks, Curvature, Diagonal, Sum
from gradmerge.curvature.diagonal import ShiftedDiagonal
from gradmerge.curvature.io import CurvatureFile, open_curvature
from gradmerge.elementwise import removal as elementwise_removal
from gradmerge.errors import (
    ArgumentError,
    ConfigError,
    GradmergeError,
    InputWarning,
    NonFiniteError,
)
from gradmerge.foundation.devices import resolve_device
from gradmerge.io import fingerprint
from gradmerge.io.lora import LoraCheckpoint, open_model
from gradmerge.io.reader import Checkpoint, open_checkpoint
from gradmerge.jobs import widened
from gradmerge.jobs.config import MergeConfig, RemoveConfig
from gradmerge.jobs.inputs import CurvatureTerm
from gradmerge.jobs.job import Job
from gradmerge.jobs.plan import Plan, Unit, build_plan, matching
from gradmerge.jobs.removal_checks import Rounding, StepSize
from gradmerge.kernels import select
from gradmerge.merge.inputs import CurvatureLike
from gradmerge.methods import registry
from gradmerge.methods.base import (
    MergeRule,
    MergeUnit,
    RemoveRule,
    RemoveUnit,
    precision,
)
from gradmerge.solvers.solution import Solution


def open_job(config: MergeConfig | RemoveConfig, stack: ExitStack) -> Job:
    """Open the inputs of ``config``, check they fit together and build the plan.

    The inputs stay open (memory-mapped) until ``stack`` closes. No tensor is read.

    Raises:
        ArgumentError: ``config`` is neither a :class:`MergeConfig` nor a :class:`RemoveConfig`.
        StructureError, DTypeError, MissingInputError, FileFormatError: as
            :func:`~gradmerge.jobs.engine.run_merge`.
    """
    if isinstance(config, MergeConfig):
        return open_merge(config, stack)
    if isinstance(config, RemoveConfig):
        return open_remove(config, stack)
    raise ArgumentError(
        f"open_job takes a MergeConfig or a RemoveConfig, got {type(config).__name__}: build one "
        "with MergeConfig.from_yaml(path) or RemoveConfig.from_yaml(path)"
    )


def open_merge(config: MergeConfig, stack: ExitStack) -> Job:
    base = stack.enter_context(open_checkpoint(config.base_model))
    models = [stack.enter_context(open_model(m.model, base, m.adapter_base)) for m in config.models]
    curvs = [
        stack.enter_context(open_curvature(m.curvature)) if m.curvature is not None else None
        for m in config.models
    ]
    prior_files = _open_term(config.prior, "prior", stack)
    files = {f"models[{i}].curvature": c for i, c in enumerate(curvs) if c is not None}
    files.update(prior_files)
    spec = registry.get(config.method)
    untouched, touched = known_changes(base, models)
    plan = build_plan(
        base,
        [(f"models[{i}].model", m) for i, m in enumerate(models)],
        list(files.items()),
        coverage=spec.coverage,
        passthrough=config.passthrough,
        out_dtype=config.out_dtype,
        allow_mixed_dtypes=config.allow_mixed_dtypes,
        untouched=untouched,
        touched=touched,
    )
    pairs = [
        (f"models[{i}].curvature", c, [(f"models[{i}].model", models[i]), ("base_model", base)])
        for i, c in enumerate(curvs)
        if c is not None
    ]
    pairs += [(name, f, [("base_model", base)]) for name, f in prior_files.items()]
    _check_curvature_weights(config.curvature_weights, pairs)
    device, dtype = resolve_device(config.device), config.math_dtype
    alphas, solver = config.alphas, config.solver
    kernel = select(math.prod(plan.shapes[k]) for k in plan.merged)  # from the mode in force
    average = frozenset(matching(base.keys(), config.average, key="average"))
    if spec.precheck is not None:  # the method's own settings against the shapes, before a read
        spec.precheck(config, {k: plan.shapes[k] for k in plan.merged if k not in average})

    widen = (  # bfloat16 in and out, float32 arithmetic: each unit's tensors as stored first
        kernel is not None
        and dtype == torch.float32
        and device.type == "cpu"
        and all(type(m) is type(base) for m in models)
    )
    declined: list[bool] = []  # the widened loop declined a unit: the job's pattern, or a fault
    found: dict[str, int] = {}  # merged tensors whose task vectors all read as zero: their blocks

    def compute(unit: Unit, rows: slice | None = None) -> tuple[dict[str, Tensor], Solution | None]:
        keys = unit.keys
        stored = widen and not declined and _stored_as(widened.DTYPE, keys, plan, base, models)
        theta, thetas = read(keys, rows, None if stored else dtype)
        if _all_zero(keys, theta, thetas, base, models):  # before any curvature read or solve
            for k in keys:
                found[k] = found.get(k, 0) + 1
            return {
                k: v if v.dtype == base.dtype(k) else base.get(k, device=device, rows=rows)
                for k, v in theta.items()
            }, None
        if stored:
            done = widened.attempt(rule, unit_of(keys, rows, None, theta, thetas))  # as stored
            if done is not None:
                return done
            declined.append(True)  # one try per job: the float32 path from here on
            theta, thetas = read(keys, rows, dtype)
        unit_inputs = unit_of(keys, rows, dtype, theta, thetas)
        try:
            return rule(unit_inputs)
        except GradmergeError as err:
            named = {f"curvatures[{t}]": h for t, h in enumerate(unit_inputs.curvatures)}
            _raise_non_finite({**named, "prior": unit_inputs.prior}, err)
            raise

    def read(
        keys: Sequence[str], rows: slice | None, dtype: torch.dtype | None
    ) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
        """θ_LLM's and every θ_t's tensors of the unit, in ``dtype`` (``None``: as stored)."""
        return _read(base, keys, device, dtype, rows), [
            _read(m, keys, device, dtype, rows) for m in models
        ]

    def unit_of(
        keys: Sequence[str],
        rows: slice | None,
        dtype: torch.dtype | None,
        theta: dict[str, Tensor],
        thetas: list[dict[str, Tensor]],
    ) -> MergeUnit:
        """The unit's inputs, its curvatures read in ``dtype`` (``None``: as stored)."""
        return MergeUnit(
            theta,
            thetas,
            [_restrict(c, keys, device, dtype, rows) for c in curvs],
            alphas,
            _term_precision(config.prior, prior_files, keys, device, dtype, rows),
            config.damping,
            kernel,
            solver=solver,
            off_diagonal=config.off_diagonal,
            curvature_scales=config.curvature_scales,
            common_space_fraction=config.common_space_fraction,
            average=average,
            embeddings=config.embeddings,
        )

    rule = cast(MergeRule, spec.rule)
    hint = spec.hint
    negative = [f"models[{i}].alpha" for i, a in enumerate(config.alphas) if a < 0]
    if negative and "curvature" in spec.uses:
        hint = (
            f"{', '.join(negative)} (times `scale`) is negative, which subtracts that model's "
            "curvature from H̄: make it smaller in magnitude, or " + hint
        )
    delta = 0.0 if config.prior is None else config.prior.delta
    return Job(
        "merge",
        plan,
        base,
        compute,
        device,
        {"base_model": base, **{f"models[{i}].model": m for i, m in enumerate(models)}},
        files,
        hint,
        dtype,
        config.source,
        example=f"more than the {delta:g} given, e.g. {10 * delta:.1e}"
        if delta > 0
        else Job.example,
        rowwise=spec.rowwise and all(type(m) is type(base) for m in models),
        unchanged=lambda unit: _all_zero(unit.keys, *read(unit.keys, None, None), base, models),
        zero_blocks=found,
    )


def known_changes(base: Checkpoint, models: Sequence[Checkpoint]) -> tuple[set[str], set[str]]:
    """What the models' headers tell of their task vectors: (the tensors every model leaves at
    the base, the tensors some model changes). Only a LoRA adapter over ``base`` tells
    (:attr:`LoraCheckpoint.changed`); with any other model nothing is known to be untouched."""
    touched: set[str] = set()
    for m in models:
        if isinstance(m, LoraCheckpoint) and m.base is base:
            touched |= m.changed
    every = all(isinstance(m, LoraCheckpoint) and m.base is base for m in models)
    untouched = {k for k in base if k not in touched} if every and models else set()
    return untouched, touched


def _all_zero(
    keys: Sequence[str],
    theta: Mapping[str, Tensor],
    thetas: Sequence[Mapping[str, Tensor]],
    base: Checkpoint,
    models: Sequence[Checkpoint],
) -> bool:
    """Whether every model's task vector is exactly zero on the unit ``keys``: each θ_t's tensors
    (``thetas``, as read) equal θ_LLM's (``theta``). A LoRA adapter over ``base`` that changes
    one of them is known not to be, without a comparison; one that changes none, to be."""
    for model, values in zip(models, thetas, strict=True):
        if isinstance(model, LoraCheckpoint) and model.base is base:
            if any(k in model.changed for k in keys):
                return False
            continue
        if not all(torch.equal(values[k], theta[k]) for k in keys):
            return False
    return True


def open_remove(config: RemoveConfig, stack: ExitStack) -> Job:
    base = stack.enter_context(open_checkpoint(config.base_model))
    model = (
        stack.enter_context(open_model(config.model, base, config.adapter_base))
        if config.model
        else None
    )
    gradient = stack.enter_context(open_checkpoint(config.gradient)) if config.gradient else None
    curv = stack.enter_context(open_curvature(config.curvature)) if config.curvature else None
    prior_files = _open_term(config.prior, "prior", stack)
    rest_files = _open_term(config.remaining, "remaining", stack)
    files = {"curvature": curv} if curv is not None else {}
    files.update(prior_files)
    files.update(rest_files)
    plan = build_plan(
        base,
        [("model", model)] if model is not None else [],
        list(files.items()),
        coverage="all",
        passthrough=config.passthrough,
        out_dtype=config.out_dtype,
        allow_mixed_dtypes=config.allow_mixed_dtypes,
        gradient=("gradient", gradient) if gradient is not None else None,
    )
    at_base: list[tuple[str, Checkpoint]] = [("base_model", base)]
    pairs = [(n, f, at_base) for n, f in files.items() if n != "curvature"]
    if curv is not None and model is not None:
        pairs.append(("curvature", curv, [("model", model), *at_base]))
    _check_curvature_weights(config.curvature_weights, pairs)
    device, dtype = resolve_device(config.device), config.math_dtype
    spec = registry.get(config.method)
    rule = cast(RemoveRule, spec.rule)
    solver = config.solver

    def compute(unit: Unit, rows: slice | None = None) -> tuple[dict[str, Tensor], Solution | None]:
        keys = unit.keys

        remaining = _term_precision(config.remaining, rest_files, keys, device, dtype)
        assert remaining is not None  # `remaining` is required by RemoveConfig
        theta = _read(base, keys, device, dtype)
        finetuned = _read(model, keys, device, dtype) if model is not None else None
        curvature = _restrict(curv, keys, device, dtype)
        prior = _term_precision(config.prior, prior_files, keys, device, dtype)
        grad = _read(gradient, keys, device, dtype) if gradient is not None else None
        unit_inputs = RemoveUnit(
            theta, remaining, config.alpha, finetuned, curvature, prior, grad, solver
        )
        try:
            out, report = rule(unit_inputs)
        except GradmergeError as err:
            named = {"curvature": curvature, "prior": prior, "remaining": remaining}
            _raise_non_finite(named, err)
            raise
        if report is not None and report.measured:  # the fused elementwise pass measured them
            stats = elementwise_removal.RemovalStats(**report.measured)
            step.step_sq += stats.step_sq
            step.reference_sq += stats.reference_sq
            assert model is not None
            rounding.add(stats, [base.dtype(k) for k in keys] + [model.dtype(k) for k in keys])
            return out, report
        reference = theta if finetuned is None else {k: finetuned[k] - theta[k] for k in keys}
        step.add({k: out[k] - theta[k] for k in keys}, reference)
        rounding.unmeasured += 1
        return out, report

    step = StepSize("the weights ‖θ_LLM‖" if model is None else "the task vector ‖θ_t − θ_LLM‖")
    rounding = Rounding(dtype)

    checkpoints = {"base_model": base}
    if model is not None:
        checkpoints["model"] = model
    if gradient is not None:
        checkpoints["gradient"] = gradient
    hint = spec.hint
    return Job(
        "remove",
        plan,
        base,
        compute,
        device,
        checkpoints,
        files,
        hint,
        dtype,
        config.source,
        step,
        rounding=rounding if spec.bounds_rounding else None,
    )


def _check_curvature_weights(
    policy: str, pairs: Sequence[tuple[str, CurvatureFile, Sequence[tuple[str, Checkpoint]]]]
) -> None:
    """Warn (``policy`` "warn") or refuse ("refuse") a curvature file whose recorded sample hash
    of the weights it was estimated at (:mod:`gradmerge.curvature.provenance`) matches none of the
    checkpoints it may describe: its own model's, or the base's. Files without a hash (written
    by hand, or before it was recorded) are not judged."""
    if policy == "ignore":
        return
    for name, file, candidates in pairs:
        stored = file.info.get(fingerprint.META_KEY)
        keys = [k for k, _ in file.layout]
        usable = [(n, c) for n, c in candidates if all(k in c for k in keys)]
        if stored is None or not usable:
            continue
        if any(fingerprint.sample_hash_from(keys, c.shape, c.rows) == stored for _, c in usable):
            continue
        which = " or ".join(f"`{n}`" for n, _ in usable)
        message = (
            f"`{name}` ({file.path}) was estimated at other weights than {which} (the sample hash "
            "of the weights it recorded at estimation matches none of them): the merge would pair "
            f"it with weights it does not describe. Estimate it at {'`' + usable[0][0] + '`'} "
            "with `gradmerge curvature`, or set `curvature_weights: ignore` if this is meant"
        )
        if policy == "refuse":
            raise ConfigError(message)
        warnings.warn(message, InputWarning, stacklevel=4)


def _open_term(term: CurvatureTerm | None, name: str, stack: ExitStack) -> dict[str, CurvatureFile]:
    """The files of a term, by input name (``prior.curvature``, ``remaining.curvature[1]``)."""
    if term is None:
        return {}
    if not isinstance(term.curvature, tuple):
        return {f"{name}.curvature": stack.enter_context(open_curvature(p)) for p in term.files}
    return {
        f"{name}.curvature[{i}]": stack.enter_context(open_curvature(p))
        for i, p in enumerate(term.files)
    }


def _term_precision(
    term: CurvatureTerm | None,
    files: Mapping[str, CurvatureFile],
    keys: Sequence[str],
    device: torch.device,
    dtype: torch.dtype | None,
    rows: slice | None = None,
) -> CurvatureLike | None:
    """δ·I + scale·ΣC of a term on one unit (the sum of its files' parts; ``rows``: as
    :func:`_restrict`)."""
    if term is None:
        return None
    parts = [
        c for f in files.values() if (c := _restrict(f, keys, device, dtype, rows)) is not None
    ]
    return precision(term.delta, term.scale, sum(parts[1:], parts[0]) if parts else None)


def _stored_as(
    dtype: torch.dtype,
    keys: Sequence[str],
    plan: Plan,
    base: Checkpoint,
    models: Sequence[Checkpoint],
) -> bool:
    """Whether the unit's tensors are stored in ``dtype`` in the base and every model and are
    written in it (its curvatures: :func:`gradmerge.jobs.widened.attempt` checks them)."""
    return all(
        plan.out_dtypes[k] == dtype and all(c.dtype(k) == dtype for c in [base, *models])
        for k in keys
    )


def _raise_non_finite(curvatures: Mapping[str, object], err: GradmergeError) -> None:
    """After a unit's rule failed with ``err``: a :class:`NonFiniteError` naming a NaN/Inf among
    the unit's diagonal curvature values, if there is one (from ``err``).

    The engine reads curvature files without their NaN/Inf check (:func:`_restrict`), which
    saves a read of every value: a non-finite value cannot pass unnoticed (the diagonal merge's
    own pass catches it, and every rule refuses a non-finite result), but the rule that fails
    may not know which input it came from. This names it, as ``curvatures[t]``, ``prior``,
    ``curvature`` or ``remaining`` (the rules' argument names)."""
    for name, curvature in curvatures.items():
        for values in _diagonal_values(curvature):
            try:
                P.check_finite(values, name=name)
            except NonFiniteError as found:
                raise found from err


def _diagonal_values(curvature: object) -> list[dict[str, Tensor]]:
    """The values of every diagonal part of ``curvature`` (the unshifted values of a lazy
    δ·I + s·C, whose finiteness is theirs)."""
    if isinstance(curvature, ShiftedDiagonal):
        return _diagonal_values(curvature.unshifted)
    if isinstance(curvature, Diagonal):
        return [curvature.values]
    if isinstance(curvature, Blocks):
        return [v for block in curvature.blocks for v in _diagonal_values(block)]
    if isinstance(curvature, Sum):
        return [v for term in curvature.terms for v in _diagonal_values(term)]
    return []


def _restrict(
    file: CurvatureFile | None,
    keys: Sequence[str],
    device: torch.device,
    dtype: torch.dtype | None,
    rows: slice | None = None,
) -> Curvature | None:
    """The unit's part of a curvature file (of ``rows`` of its one tensor only, when given), as
    loaded (the ``solver:`` settings go to each solve: ``config.solver``); diagonal values are read
    without their NaN/Inf check (:meth:`CurvatureFile.restrict` with
    ``check_finite=False``: one read less), which the unit's rule and :func:`_raise_non_finite`
    make up for."""
    if file is None:
        return None
    return file.restrict(keys, device=device, dtype=dtype, check_finite=False, rows=rows)


def _read(
    ckpt: Checkpoint,
    keys: Sequence[str],
    device: torch.device,
    dtype: torch.dtype | None,
    rows: slice | None = None,
) -> dict[str, Tensor]:
    """The unit's tensors in ``dtype`` (``None``: as stored; ``rows`` of them only, read and
    converted alone)."""
    return {k: ckpt.get(k, device=device, dtype=dtype, rows=rows) for k in keys}
