"""The streaming engine: ``run_merge`` and ``run_remove`` over checkpoint files.

For every unit of the plan (:mod:`gradmerge.jobs.plan`: the smallest group of tensors some
curvature couples) the engine reads that unit's tensors from every input — base, fine-tuned
models, the unit's part of each curvature file, the gradient — on the chosen device in the
compute dtype, calls the pure rule of :mod:`gradmerge.merge` on these sub-dicts
(:mod:`gradmerge.jobs.rules`), casts the result to the output dtype and appends it to the
output shards. Peak memory is a few units' tensors: the inputs are memory-mapped and read one
unit at a time, the output is written as it comes. A tensor larger than :data:`ROW_BLOCK_BYTES`
(in the compute dtype) that its method merges elementwise — task arithmetic, and Fisher
averaging and gradient matching where its curvatures are diagonal or δ·I — is read, merged and
written a block of rows at a time (:meth:`Job.row_blocks`), so that peak memory stays bounded
whatever the tensor's size and dtype: a 128k-token bfloat16 embedding would otherwise be read as
several float32 copies of the whole matrix. The result is the same bit for bit. A dense curvature couples every parameter it
covers, so with one the whole model is a single unit (and must fit in memory).

The output folder appears only when everything succeeded (:func:`staged_output`); it holds the
shards, the base's config and tokenizer files (``dtype`` in config.json updated), a model card
(README.md, :mod:`gradmerge.jobs.card`; never the base's own) and a record,
``gradmerge_merge.json`` / ``gradmerge_remove.json``: method, α, prior, dtypes, device, gradmerge
and torch versions, each input's fingerprint (a SHA-256 content hash of its values, exact on
every small tensor and on 16 evenly spaced rows of every large one:
:func:`gradmerge.io.fingerprint.content_hash`; and of its safetensors headers) and each curvature
file's metadata.

The same steps are public for drivers that split the work (:mod:`gradmerge.distributed.merge`
gives each rank its own units): :func:`open_job` opens the inputs and builds the plan,
:meth:`Job.compute_unit` computes one unit's output tensors, :func:`check_output` refuses an
output folder the guard refuses (:mod:`gradmerge._guard`: one that is, lies inside or holds an
input), :meth:`Job.copy_assets`, :meth:`Job.record` and :meth:`Job.write_card` finish the output
folder. :func:`run_merge` is these steps with one :class:`ShardedWriter` in a staged folder.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from torch import Tensor

from gradmerge import _guard
from gradmerge import params as P
from gradmerge._devices import resolve_device
from gradmerge._guard import Output
from gradmerge._text import key_list
from gradmerge._version import __version__
from gradmerge.curvature import Blocks, Curvature, Diagonal, Sum
from gradmerge.curvature.diagonal import ShiftedDiagonal
from gradmerge.curvature.io import CurvatureFile, open_curvature
from gradmerge.elementwise import removal as _removal
from gradmerge.errors import (
    PD_FIX,
    ArgumentError,
    ConfigError,
    GradmergeError,
    InputWarning,
    NonFiniteError,
    NotConvergedError,
    NotPositiveDefiniteError,
    ResultOverflowError,
    StepTooLargeError,
)
from gradmerge.io import fingerprint as _weight_sample
from gradmerge.io.lora import open_model
from gradmerge.io.reader import Checkpoint, open_checkpoint
from gradmerge.io.writer import ShardedWriter, remove_stale_stages, staged_output
from gradmerge.jobs import card, methods, rules
from gradmerge.jobs.config import CurvatureTerm, MergeConfig, Options, RemoveConfig
from gradmerge.jobs.plan import Plan, Unit, build_plan, matching
from gradmerge.jobs.progress import Progress
from gradmerge.kernels import memory, select
from gradmerge.solvers.solution import Solution
from gradmerge.spectral import iso_cts_split

ROW_BLOCK_BYTES = 32 << 20
"""A merged tensor larger than this in the compute dtype is merged a block of rows of about this
size at a time where its method is elementwise on it (:meth:`Job.row_blocks`): every input's
block is read and converted alone, so memory holds a few such blocks, never the whole tensor."""


class UnitFn(Protocol):
    """A unit's computation (of ``rows`` of its one tensor only, when given): its tensors, and
    the report of its solve (``None``: none ran)."""

    def __call__(
        self, unit: Unit, rows: slice | None = None
    ) -> tuple[dict[str, Tensor], Solution | None]: ...


@dataclass(frozen=True)
class MergeReport:
    """What a ``run_merge`` / ``run_remove`` did.

    Attributes:
        out_dir: the output folder.
        files: the files written there (shards, index, copied config files, record).
        tensors: tensors written; ``merged`` of them merged, ``copied`` copied from the base.
        units: units processed (see :mod:`gradmerge.jobs.plan`).
        bytes_read: tensor bytes read from all inputs (checkpoints and curvature files).
        bytes_written: bytes of the safetensors shards.
        seconds: wall time of the run.
        device: where the arithmetic ran.
        stale_removed: hidden staging folders of ``out_dir`` left by killed runs, removed.
        stale_left: such folders whose owner cannot be known (another host, an older
            gradmerge), left in place.
        notes: lines for the user, e.g. a removal's step size (:class:`StepSize`).
        solves: per solved block (a K-FAC layer, or a unit's name), how its system was solved:
            ``{"method", "iterations", "residual", "success"}`` (also in the record, under
            ``"solves"``); ``success`` is False only for ``solver: {approximate: true}`` solves
            that stopped above ``solver.tol``.
        max_residual: the largest relative residual ‖b − Kx‖/‖b‖ measured over ``solves``
            (0.0 when no solve measured one, e.g. elementwise merges).
    """

    out_dir: Path
    files: tuple[Path, ...]
    tensors: int
    merged: int
    copied: int
    units: int
    bytes_read: int
    bytes_written: int
    seconds: float
    device: str
    stale_removed: tuple[Path, ...] = ()
    stale_left: tuple[Path, ...] = ()
    notes: tuple[str, ...] = ()
    solves: dict[str, dict[str, Any]] = field(default_factory=dict)
    max_residual: float = 0.0


def run_merge(
    config: MergeConfig,
    out_dir: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> MergeReport:
    """Merge the checkpoints of ``config`` into ``out_dir``, streaming unit by unit.

    Args:
        config: what to merge and how (:class:`MergeConfig`, e.g. from ``MergeConfig.from_yaml``).
        out_dir: the output folder; it must not exist unless ``overwrite``.
        overwrite: replace an existing ``out_dir`` (only once the new output is complete).
        progress: show a progress bar on stderr (only when stderr is a terminal).

    Raises:
        OutputExistsError, OutputOverlapError, OutputWriteError: ``out_dir`` exists and
            ``overwrite`` is false; it is, lies inside or contains an input; it cannot be
            written (:func:`check_output`, :mod:`gradmerge._guard`).
        StructureError, DTypeError: inputs that do not fit together (the tensor is named).
        NotPositiveDefiniteError: a singular system (the message says which prior/damping to raise).
        FileFormatError: a corrupt or truncated input.
        InputChangedError: an input file changed while the merge read it (nothing written).

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from safetensors.torch import save_file, load_file
        >>> from gradmerge.jobs import MergeConfig, run_merge
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     d = Path(tmp)
        ...     save_file({"w": torch.zeros(2), "step": torch.tensor(3)}, d / "base.safetensors")
        ...     save_file({"w": torch.ones(2), "step": torch.tensor(9)}, d / "ft.safetensors")
        ...     cfg = MergeConfig.from_dict(
        ...         {"method": "task_arithmetic", "base_model": "base.safetensors",
        ...          "models": [{"model": "ft.safetensors", "alpha": 0.5}]}, root=d)
        ...     report = run_merge(cfg, d / "out", progress=False)
        ...     print(load_file(d / "out" / "model.safetensors"), report.merged, report.copied)
        {'step': tensor(3), 'w': tensor([0.5000, 0.5000])} 1 1
    """
    with ExitStack() as stack:
        start = time.perf_counter()
        snapshot = check_output(config, out_dir, overwrite=overwrite)
        job = _open_merge(config, stack)
        return _execute(job, config, out_dir, overwrite, progress, start, snapshot)


def run_remove(
    config: RemoveConfig,
    out_dir: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> MergeReport:
    """Remove data from the base model of ``config`` into ``out_dir`` (Eq. 13 or Koh & Liang).

    Streams unit by unit like :func:`run_merge`; same arguments and errors. A removal whose
    remaining curvature H̄_\\t is not positive definite raises
    :class:`NotPositiveDefiniteError`, suggesting ``remaining: {delta: ...}``.
    """
    with ExitStack() as stack:
        start = time.perf_counter()
        snapshot = check_output(config, out_dir, overwrite=overwrite)
        job = _open_remove(config, stack)
        return _execute(job, config, out_dir, overwrite, progress, start, snapshot)


def plan_merge(config: MergeConfig) -> Plan:
    """Check the inputs of a merge and return its plan, reading no tensor (``--dry-run``)."""
    with ExitStack() as stack:
        return _open_merge(config, stack).plan


def plan_remove(config: RemoveConfig) -> Plan:
    """Check the inputs of a removal and return its plan, reading no tensor (``--dry-run``)."""
    with ExitStack() as stack:
        return _open_remove(config, stack).plan


@dataclass
class StepSize:
    """‖θ_\\t − θ_LLM‖ of a removal against a reference norm, summed unit by unit.

    The reference is the task vector ‖θ_t − θ_LLM‖ (Eq. 13) or the weights ‖θ_LLM‖ (Koh &
    Liang). A ratio far above 1 means a direction where the remaining curvature H̄_\\t is near
    zero has exploded (H̄_\\t⁻¹ multiplies by up to 1/δ there).

    Example:
        >>> import torch
        >>> s = StepSize("the task vector ‖θ_t − θ_LLM‖")
        >>> s.add({"w": torch.tensor([3.0, 4.0])}, {"w": torch.tensor([0.0, 1.0])})
        >>> s.ratio
        5.0
    """

    reference: str
    step_sq: float = 0.0
    reference_sq: float = 0.0

    def add(self, step: Mapping[str, Tensor], reference: Mapping[str, Tensor]) -> None:
        """Add one unit's step and reference tensors (same keys)."""
        for k, v in step.items():
            self.step_sq += float(v.double().square().sum())
            self.reference_sq += float(reference[k].double().square().sum())

    @property
    def ratio(self) -> float:
        """‖step‖ / ‖reference‖ (inf for a non-zero step against a zero reference)."""
        if self.reference_sq == 0.0:
            return 0.0 if self.step_sq == 0.0 else math.inf
        return math.sqrt(self.step_sq / self.reference_sq)

    def describe(self) -> str:
        """One line: the step's norm, and its ratio to the reference."""
        return (
            f"removal step ‖θ_\\t − θ_LLM‖ = {math.sqrt(self.step_sq):.4g}, {self.ratio:.3g}× "
            f"{self.reference} ({math.sqrt(self.reference_sq):.4g})"
        )

    def check(self, policy: str, limit: float) -> None:
        """Refuse (``policy`` "refuse": :class:`StepTooLargeError`) or warn ("warn") when the
        ratio exceeds ``limit``; "ignore" does neither."""
        if policy == "ignore" or self.ratio <= limit:
            return
        message = (
            f"the {self.describe()} exceeds `max_relative_step: {limit:g}`: a direction where "
            "the remaining curvature H̄_\\t is near zero exploded. Raise `remaining: {delta: "
            "...}` (the base model's prior precision), add the curvature of the data that stays "
            "to `remaining.curvature`, or set `step_check: warn` to write it anyway"
        )
        if policy == "refuse":
            raise StepTooLargeError(message)
        warnings.warn(message, InputWarning, stacklevel=3)


@dataclass
class Rounding:
    """How much a removal (Eq. 13) amplifies the rounding its inputs carry, summed unit by unit.

    Each input θ is known only to ε/2 relative (ε: the coarser of its stored dtype and the
    compute dtype, in which it is read); where r = |α|(H_0 + H_t)/H̄_\\t is large, Eq. 13
    multiplies that by r (:mod:`gradmerge._removal`). The bound ‖e‖₂ is compared with the task
    vector ‖θ_t − θ_LLM‖. Measured for elementwise (diagonal, δ·I) units; ``unmeasured`` counts
    the others (K-FAC, dense), where it is not bounded.

    Example:
        >>> import torch
        >>> from gradmerge.elementwise.removal import RemovalStats
        >>> r = Rounding(torch.float32)
        >>> r.add(RemovalStats(reference_sq=1.0, amplified_sq=4e12, max_ratio=1e6), [torch.float32])
        >>> round(r.bound, 3), r.ratio > 1e-2
        (0.119, True)
    """

    compute: torch.dtype
    bound_sq: float = 0.0
    reference_sq: float = 0.0
    max_ratio: float = 0.0
    eps: float = 0.0
    unmeasured: int = 0

    def add(self, stats: _removal.RemovalStats, stored: Sequence[torch.dtype]) -> None:
        """Add one unit's measurements; ``stored``: the dtypes its inputs are stored in."""
        eps = max(torch.finfo(d).eps for d in (*stored, self.compute) if d.is_floating_point)
        self.eps = max(self.eps, eps)
        self.bound_sq += (eps / 2) ** 2 * stats.amplified_sq
        self.reference_sq += stats.reference_sq
        self.max_ratio = max(self.max_ratio, stats.max_ratio)

    @property
    def bound(self) -> float:
        """‖e‖₂, the bound on the error the inputs' rounding causes in the result."""
        return math.sqrt(self.bound_sq)

    @property
    def ratio(self) -> float:
        """‖e‖₂ / ‖θ_t − θ_LLM‖ (inf for a non-zero bound against a zero task vector)."""
        if self.reference_sq == 0.0:
            return 0.0 if self.bound_sq == 0.0 else math.inf
        return math.sqrt(self.bound_sq / self.reference_sq)

    def describe(self) -> str:
        """One line: the bound, relative to the task vector, and the largest amplification."""
        kind = "float64" if self.eps <= torch.finfo(torch.float64).eps else "float32 or coarser"
        return (
            f"rounding bound of the removal {self.bound:.3g} = {self.ratio:.3g}× the task vector "
            f"(largest amplification |α|(H_0 + H_t)/H̄_\\t = {self.max_ratio:.3g} of inputs known "
            f"to {kind} precision)"
        )

    def check(self, policy: str, limit: float) -> None:
        """Refuse (:class:`StepTooLargeError`) or warn when the bound exceeds ``limit`` × the task
        vector; "ignore" does neither."""
        if policy == "ignore" or self.ratio <= limit:
            return
        wider = (
            "store θ_LLM and θ_t in float64 and set `compute_dtype: float64` (a float32 merge "
            "has already lost those digits), "
            if self.eps > torch.finfo(torch.float64).eps
            else ""
        )
        message = (
            f"the {self.describe()} exceeds `max_rounding: {limit:g}`: where H̄_\\t is tiny next "
            "to H_0 + H_t (e.g. rows only the removed task trained), Eq. 13 multiplies the "
            "rounding of the stored weights into an error larger than that share of the step. "
            "Re-merge without the task instead (`method: remerge`, exact), "
            f"{wider}raise `remaining: {{delta: ...}}`, or set `rounding_check: warn` to write "
            "it anyway"
        )
        if policy == "refuse":
            raise StepTooLargeError(message)
        warnings.warn(message, InputWarning, stacklevel=3)


# ----- jobs: opened inputs, a plan, and how to compute one unit ----------------------------------
@dataclass
class Job:
    """The opened inputs of a merge or removal, its plan, and how to compute one unit.

    Made by :func:`open_job`; valid while the ``ExitStack`` given there is open (the inputs are
    memory-mapped). A driver computes every unit of ``plan.units`` with :meth:`compute_unit` and
    writes the tensors in that order; :func:`run_merge` does exactly this with one writer,
    :mod:`gradmerge.distributed.merge` with one writer per rank.

    Attributes:
        command: ``"merge"`` or ``"remove"``.
        plan: the units, their shapes and output dtypes (:class:`~gradmerge.jobs.plan.Plan`).
        base: the base checkpoint θ_LLM (its config/tokenizer files are the output's).
        device: where the arithmetic runs.
        checkpoints: input name (as in the record: ``base_model``, ``models[0].model``, ...) →
            opened checkpoint.
        curvatures: input name (``models[0].curvature``, ``prior.curvature``, ...) → opened
            curvature file.
        hint: how to fix a singular system, added to a :class:`NotPositiveDefiniteError`
            (``{example}`` stands for a suggested δ).
        example: the δ suggested when the error names none (a generic one, or ten times the
            prior's δ where the configuration has one: a smaller example would not help).
        math_dtype: the compute dtype.
        source: the configuration file, if any (an output folder must not hold it either).
        rowwise: whether the method merges elementwise where its curvatures are elementwise, and
            every input is a stored checkpoint (a LoRA adapter's tensor is formed whole), so
            that :meth:`row_blocks` may split a large tensor.

    Example:
        >>> import tempfile, torch
        >>> from contextlib import ExitStack
        >>> from pathlib import Path
        >>> from safetensors.torch import save_file
        >>> from gradmerge.jobs import MergeConfig
        >>> from gradmerge.jobs.engine import open_job
        >>> with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        ...     d = Path(tmp)
        ...     save_file({"w": torch.zeros(2)}, d / "base.safetensors")
        ...     save_file({"w": torch.ones(2)}, d / "ft.safetensors")
        ...     cfg = MergeConfig.from_dict(
        ...         {"method": "task_arithmetic", "base_model": "base.safetensors",
        ...          "models": [{"model": "ft.safetensors", "alpha": 0.5}]}, root=d)
        ...     job = open_job(cfg, stack)
        ...     [job.compute_unit(u) for u in job.plan.units]
        [{'w': tensor([0.5000, 0.5000])}]
    """

    command: str
    plan: Plan
    base: Checkpoint
    compute: UnitFn
    device: torch.device
    checkpoints: dict[str, Checkpoint]
    curvatures: dict[str, CurvatureFile]
    hint: str
    math_dtype: torch.dtype = torch.float32
    source: Path | None = None
    step: StepSize | None = None
    rounding: Rounding | None = None
    solves: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per solved block, how its system was solved (filled by :meth:`compute_unit`)."""
    example: str = "e.g. 1.0e-6"
    rowwise: bool = False

    @property
    def max_residual(self) -> float:
        """The largest measured relative residual over :attr:`solves` (0.0 if none)."""
        values = [r for v in self.solves.values() if (r := v["residual"]) == r]
        return max(values, default=0.0)

    @property
    def wide(self) -> bool:
        """Whether the arithmetic already runs in float64 (no wider dtype to suggest)."""
        return self.math_dtype == torch.float64

    def row_blocks(self, unit: Unit) -> list[slice | None]:
        """How to compute ``unit``: ``[None]`` (whole), or the blocks of rows of its one tensor,
        each about :data:`ROW_BLOCK_BYTES` in the compute dtype, when the tensor is larger than
        that and its merge is elementwise (:attr:`rowwise`, and every curvature file diagonal
        or δ·I on it): rows of the result then depend only on the same rows of every input.
        """
        shape, itemsize = self.plan.shapes[unit.keys[0]], self.math_dtype.itemsize
        if (
            len(unit.keys) > 1
            or not unit.merged
            or not self.rowwise
            or len(shape) == 0
            or math.prod(shape) * itemsize <= ROW_BLOCK_BYTES
            or not all(f.elementwise(unit.keys) for f in self.curvatures.values())
        ):
            return [None]
        step = max(1, ROW_BLOCK_BYTES // (math.prod(shape[1:]) * itemsize))
        return [slice(i, min(i + step, shape[0])) for i in range(0, shape[0], step)]

    def prefetch(self, unit: Unit, rows: slice | None = None) -> None:
        """Start reading ``unit``'s tensors (``rows`` of them) from every input into the page
        cache in the background, to be called before computing the unit ahead of it, so that
        reading and arithmetic overlap (:mod:`gradmerge._readahead`; a hint only)."""
        sources = self.checkpoints.values() if unit.merged else [self.base]
        for ckpt in sources:
            for k in unit.keys:
                ckpt.prefetch(k, rows)
        if unit.merged:
            for f in self.curvatures.values():
                f.prefetch(unit.keys, rows)

    def compute_unit(self, unit: Unit, rows: slice | None = None) -> dict[str, Tensor]:
        """The output tensors of ``unit`` (key → tensor in its output dtype, on ``device``);
        ``rows``: of those rows of its one tensor only (one of :meth:`row_blocks`).

        A merged unit goes through the pure rule of :mod:`gradmerge.merge`; a copied one is the
        base's tensors (on the CPU). The result is the same whoever calls it, in any order.

        Raises:
            NotPositiveDefiniteError: a singular system (the message names the unit and the fix).
            ResultOverflowError: a result that overflows the compute or the output dtype.
            GradmergeError: any other error of the rule, naming the unit.
        """
        if not unit.merged:
            return _copy_unit(self, unit)
        out, report = _run_unit(self, unit, rows)
        if report is not None:
            for name, part in (report.parts or {key_list(unit.keys, 3): report}).items():
                if part.residual == part.residual:  # measured solves only
                    self.solves[name] = part.summary()
        return out

    @property
    def bytes_read(self) -> int:
        """Tensor bytes read so far from every input (checkpoints and curvature files)."""
        return sum(c.bytes_read for c in self.checkpoints.values()) + sum(
            f.bytes_read for f in self.curvatures.values()
        )

    def copy_assets(self, folder: Path, dtype: str | None) -> list[Path]:
        """Copy the base's config/tokenizer files into ``folder`` (``dtype`` set in config.json)."""
        return _copy_assets(self.base, folder, dtype)

    def record(self, config: Options, shards: list[Path], seconds: float) -> dict[str, Any]:
        """The ``gradmerge_<command>.json`` record: versions, config, inputs' fingerprints, output."""
        return _record(self, config, shards, seconds)

    def write_card(self, folder: Path, config: Options, record: Mapping[str, Any]) -> Path:
        """Write ``folder``/README.md, the model card made from ``record``
        (:mod:`gradmerge.jobs.card`), with ``config``'s YAML file when it still reads as
        ``config`` (``gradmerge tune`` runs settings the file does not hold)."""
        source = None
        if config.source is not None and config.source.is_file():
            try:
                with warnings.catch_warnings():  # read once more: its warnings were given
                    warnings.simplefilter("ignore")
                    if type(config).from_yaml(config.source) == config:
                        source = config.source.read_text()
            except GradmergeError:
                source = None
        base = Path(self.base.folder or self.base.path)
        return card.write(folder, record, source=source, base=base)


def open_job(config: MergeConfig | RemoveConfig, stack: ExitStack) -> Job:
    """Open the inputs of ``config``, check they fit together and build the plan.

    The inputs stay open (memory-mapped) until ``stack`` closes. No tensor is read.

    Raises:
        ArgumentError: ``config`` is neither a :class:`MergeConfig` nor a :class:`RemoveConfig`.
        StructureError, DTypeError, MissingInputError, FileFormatError: as :func:`run_merge`.
    """
    if isinstance(config, MergeConfig):
        return _open_merge(config, stack)
    if isinstance(config, RemoveConfig):
        return _open_remove(config, stack)
    raise ArgumentError(
        f"open_job takes a MergeConfig or a RemoveConfig, got {type(config).__name__}: build one "
        "with MergeConfig.from_yaml(path) or RemoveConfig.from_yaml(path)"
    )


def _open_merge(config: MergeConfig, stack: ExitStack) -> Job:
    base = stack.enter_context(open_checkpoint(config.base_model))
    models = [stack.enter_context(open_model(m.model, base, m.adapter_base)) for m in config.models]
    curvs = [
        stack.enter_context(open_curvature(m.curvature)) if m.curvature is not None else None
        for m in config.models
    ]
    prior_files = _open_term(config.prior, "prior", stack)
    files = {f"models[{i}].curvature": c for i, c in enumerate(curvs) if c is not None}
    files.update(prior_files)
    spec = methods.get(config.method)
    plan = build_plan(
        base,
        [(f"models[{i}].model", m) for i, m in enumerate(models)],
        list(files.items()),
        coverage=spec.coverage,
        passthrough=config.passthrough,
        out_dtype=config.out_dtype,
        allow_mixed_dtypes=config.allow_mixed_dtypes,
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
    if "common_space_fraction" in spec.uses:  # Iso-CTS: every matrix's split, before any read
        _check_common_space(config, plan, average)

    def compute(unit: Unit, rows: slice | None = None) -> tuple[dict[str, Tensor], Solution | None]:
        keys = unit.keys
        theta = _read(base, keys, device, dtype, rows)
        fts = [_read(m, keys, device, dtype, rows) for m in models]
        hs = [_restrict(c, keys, device, dtype, rows) for c in curvs]
        prior = _term_precision(config.prior, prior_files, keys, device, dtype, rows)
        unit_inputs = rules.MergeUnit(
            theta,
            fts,
            hs,
            alphas,
            prior,
            config.damping,
            kernel,
            solver=solver,
            off_diagonal=config.off_diagonal,
            curvature_scales=config.curvature_scales,
            common_space_fraction=config.common_space_fraction,
            average=average,
            embeddings=config.embeddings,
        )
        try:
            return rule(unit_inputs)
        except GradmergeError as err:
            named = {f"curvatures[{t}]": h for t, h in enumerate(hs)}
            _raise_non_finite({**named, "prior": prior}, err)
            raise

    rule = cast(rules.MergeRule, spec.rule)
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
    )


def _check_common_space(config: MergeConfig, plan: Plan, average: frozenset[str]) -> None:
    """Refuse a ``common_space_fraction`` that some merged matrix cannot be split by
    (:func:`gradmerge.spectral.iso_cts_split`), naming it, before a tensor is read."""
    for k in plan.merged:
        shape = plan.shapes[k]
        if len(shape) == 2 and k not in average:
            try:
                iso_cts_split(min(shape), len(config.models), config.common_space_fraction)
            except ArgumentError as err:
                raise ConfigError(f"{err} ({k!r}, {shape[0]}×{shape[1]})") from err


def _open_remove(config: RemoveConfig, stack: ExitStack) -> Job:
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
    spec = methods.get(config.method)
    rule = cast(rules.RemoveRule, spec.rule)
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
        unit_inputs = rules.RemoveUnit(
            theta, remaining, config.alpha, finetuned, curvature, prior, grad, solver
        )
        try:
            out, report = rule(unit_inputs)
        except GradmergeError as err:
            named = {"curvature": curvature, "prior": prior, "remaining": remaining}
            _raise_non_finite(named, err)
            raise
        if report is not None and report.measured:  # the fused elementwise pass measured them
            stats = _removal.RemovalStats(**report.measured)
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
        rounding=rounding if config.method == "remove" else None,
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
        stored = file.info.get(_weight_sample.META_KEY)
        keys = [k for k, _ in file.layout]
        usable = [(n, c) for n, c in candidates if all(k in c for k in keys)]
        if stored is None or not usable:
            continue
        if any(_weight_sample.sample_hash_from(keys, c.shape, c.rows) == stored for _, c in usable):
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
    dtype: torch.dtype,
    rows: slice | None = None,
) -> rules.Precision | None:
    """δ·I + scale·ΣC of a term on one unit (the sum of its files' parts; ``rows``: as
    :func:`_restrict`)."""
    if term is None:
        return None
    parts = [
        c for f in files.values() if (c := _restrict(f, keys, device, dtype, rows)) is not None
    ]
    return rules.precision(term.delta, term.scale, sum(parts[1:], parts[0]) if parts else None)


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
    dtype: torch.dtype,
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
    dtype: torch.dtype,
    rows: slice | None = None,
) -> dict[str, Tensor]:
    """The unit's tensors in the compute dtype (``rows`` of them only, read and converted alone)."""
    return {k: ckpt.get(k, device=device, dtype=dtype, rows=rows) for k in keys}


# ----- execution: units → shards, in a staged folder ----------------------------------------------
def _execute(
    job: Job,
    config: Options,
    out_dir: str | os.PathLike[str],
    overwrite: bool,
    progress: bool,
    start: float,
    snapshot: _guard.Snapshot,
) -> MergeReport:
    target = Path(out_dir).absolute()
    plan = job.plan
    entries = [(k, plan.shapes[k], plan.out_dtypes[k]) for u in plan.units for k in u.keys]
    bar = _progress(progress, plan.out_bytes(), job.command, len(entries))
    removed, left = remove_stale_stages(target)
    with (
        staged_output(target, overwrite=overwrite) as stage,
        memory.recycling(),  # each output is written and dropped before the next is made
    ):
        writer = ShardedWriter(stage, entries, config.max_shard_size)
        try:
            singular: list[tuple[Unit, NotPositiveDefiniteError]] = []
            steps = [(unit, rows) for unit in plan.units for rows in job.row_blocks(unit)]
            found: list[NotPositiveDefiniteError] = []  # the current unit's singular blocks
            for i, (unit, rows) in enumerate(steps):
                if i + 1 < len(steps):  # the disk reads the next step while this one computes
                    job.prefetch(*steps[i + 1])
                try:
                    out = job.compute_unit(unit, rows)
                except NotPositiveDefiniteError as err:
                    # go on checking the other units (and blocks), so that one run names every
                    # unit that needs damping; nothing more is written, and nothing is published
                    found.append(err)
                else:
                    if not singular and not found:
                        _write(writer, bar, out, rows, plan)
                    del out
                if found and (i + 1 == len(steps) or steps[i + 1][0] is not unit):
                    # the unit's block that needs the most damping speaks for it
                    singular.append((unit, max(found, key=lambda e: e.suggested_delta or 0.0)))
                    found = []
            if singular:
                raise _all_singular(job, singular)
            shards = writer.finish()
        finally:
            writer.abort()
            if bar is not None:
                bar.close()
        notes: tuple[str, ...] = ()
        if job.step is not None and isinstance(config, RemoveConfig):
            job.step.check(config.step_check, config.max_relative_step)  # before publishing
            notes = (job.step.describe(),)
        if job.rounding is not None and isinstance(config, RemoveConfig):
            job.rounding.check(config.rounding_check, config.max_rounding)
            if job.rounding.unmeasured == 0:
                notes = (*notes, job.rounding.describe())
        assets = job.copy_assets(stage, config.dtype)
        seconds = time.perf_counter() - start
        bytes_read = job.bytes_read
        record = stage / f"gradmerge_{job.command}.json"
        facts = job.record(config, shards, seconds)
        record.write_text(json.dumps(facts, indent=2) + "\n")
        readme = job.write_card(stage, config, facts)
        names = [p.name for p in (*shards, *assets, record, readme)]
        snapshot.check()  # an input rewritten while read: nothing is published
    return MergeReport(
        out_dir=target,
        files=tuple(target / n for n in names),
        tensors=len(entries),
        merged=len(plan.merged),
        copied=len(plan.copied),
        units=len(plan.units),
        bytes_read=bytes_read,
        bytes_written=writer.bytes_written,
        seconds=time.perf_counter() - start,
        device=str(job.device),
        stale_removed=tuple(removed),
        stale_left=tuple(left),
        notes=notes,
        solves=dict(job.solves),
        max_residual=job.max_residual,
    )


def _write(
    writer: ShardedWriter,
    bar: Progress | None,
    out: dict[str, Tensor],
    rows: slice | None,
    plan: Plan,
) -> None:
    """Append a step's output: whole tensors, or the block ``rows`` of the unit's one tensor."""
    for k, value in out.items():
        if rows is None:
            writer.write(k, value)
        else:
            writer.write_rows(k, value, rows.start)
        if bar is not None:
            done = rows is None or rows.stop == plan.shapes[k][0]
            bar.update(_nbytes(value), items=int(done))


def _run_unit(
    job: Job, unit: Unit, rows: slice | None = None
) -> tuple[dict[str, Tensor], Solution | None]:
    where = key_list(unit.keys, 3) + ("" if rows is None else f" (rows {rows.start}:{rows.stop})")
    try:
        merged, report = job.compute(unit, rows)
    except NotPositiveDefiniteError as err:
        delta = err.suggested_delta
        example = job.example if delta is None else f"at least {delta:.1e}"
        hint = job.hint.format(example=example)
        what = str(err).split(f" {PD_FIX}")[0]  # the Python keywords' fix gives way to the YAML's
        new = NotPositiveDefiniteError(
            f"{what} While computing {where}: {hint} (`gradmerge {job.command} "
            "--dry-run` checks every unit's system without writing)."
        )
        new.suggested_delta = delta
        raise new from err
    except ResultOverflowError as err:
        raise ResultOverflowError(
            f"{err} (while computing {where}; in the config: smaller `alpha`/`scale`, "
            f"a larger `delta`{'' if job.wide else ', or `compute_dtype: float64`'})"
        ) from err
    except NotConvergedError as err:
        text = str(err)
        if job.wide:  # the solver's generic advice; this run already computes in float64
            for advice in (
                " work in float64,",
                ", or compute in float64",
                " or compute in float64",
            ):
                text = text.replace(advice, "")
            text += " (the arithmetic already runs in float64 here)"
        raise NotConvergedError(
            f"{text} (while computing {where}; in the config: a larger "
            "`prior: {delta: ...}`/`damping`, or `solver: {maxiter: ...}`)"
        ) from err
    except GradmergeError as err:
        raise type(err)(f"{err} (while computing {where})") from err
    out = {}
    for k in unit.keys:
        dtype = job.plan.out_dtypes[k]
        value = merged[k].to(dtype=dtype)
        if value.element_size() < merged[k].element_size() and not bool(
            torch.isfinite(value).all()
        ):
            name = str(dtype).removeprefix("torch.")
            wider = "float64" if dtype == torch.float32 else "float32"
            raise ResultOverflowError(
                f"the result for {k!r} overflows the output dtype {name} (largest magnitude "
                f"{float(merged[k].abs().max()):.3e}, above {torch.finfo(dtype).max:.3e}): write "
                f"a wider dtype (`dtype: {wider}`), or use smaller `alpha`/`scale`"
            )
        out[k] = value
    return out, report


def _all_singular(
    job: Job, singular: Sequence[tuple[Unit, NotPositiveDefiniteError]]
) -> NotPositiveDefiniteError:
    """One error naming every unit whose system was singular, with the damping that lifts all of
    them (the largest suggested; a generic example when no unit suggested one)."""
    if len(singular) == 1:
        return singular[0][1]
    deltas = [d for _, e in singular if (d := e.suggested_delta) is not None]
    delta = max(deltas) if deltas else None
    example = job.example if delta is None else f"at least {delta:.1e}"
    lines = []
    for unit, err in singular:
        cause = err.__cause__ if isinstance(err.__cause__, NotPositiveDefiniteError) else err
        lines.append(f"{key_list(unit.keys, 3)}: {str(cause).split(f' {PD_FIX}')[0]}")
    merged = sum(1 for u in job.plan.units if u.merged)
    new = NotPositiveDefiniteError(
        f"{len(singular)} of {merged} merged units have a singular system: "
        + "; ".join(line.rstrip(". ") for line in lines)
        + f". Fix: {job.hint.format(example=example)} (`gradmerge {job.command} --dry-run` "
        "checks the same systems without writing)."
    )
    new.suggested_delta = delta
    return new


def _copy_unit(job: Job, unit: Unit) -> dict[str, Tensor]:
    return {k: job.base.get(k, dtype=job.plan.out_dtypes[k]) for k in unit.keys}


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _progress(enabled: bool, total: int, command: str, tensors: int) -> Progress | None:
    """Bytes and tensors written: a bar on a terminal, timed log lines elsewhere."""
    if not enabled:
        return None
    return Progress(f"gradmerge {command}", total, unit="B", items="tensors", items_total=tensors)


def check_output(
    config: MergeConfig | RemoveConfig, out_dir: str | os.PathLike[str], *, overwrite: bool
) -> _guard.Snapshot:
    """The output guard (:func:`gradmerge._guard.check`) for ``out_dir`` against every input of
    ``config`` (:meth:`~gradmerge.jobs.config.FromYaml.inputs`), before any input is opened;
    returns the inputs' :class:`~gradmerge._guard.Snapshot`, checked again before the output is
    renamed into place.

    Raises:
        OutputOverlapError: ``out_dir`` is, lies inside or contains an input.
        OutputExistsError: ``out_dir`` exists and not ``overwrite``.
        OutputWriteError: ``out_dir`` is a file, lies below one, or its folder is not writable.
    """
    inputs = config.inputs()
    _guard.check([Output("OUT_DIR", Path(out_dir), "folder")], inputs, overwrite=overwrite)
    # the files read while the merge runs (the configuration was read once, before)
    return _guard.Snapshot.of([i for i in inputs if i.role != "CONFIG"])


def _copy_assets(base: Checkpoint, stage: Path, dtype: str | None) -> list[Path]:
    copied = []
    for src in base.assets():
        dst = stage / src.name
        shutil.copyfile(src, dst)
        if src.name == "config.json" and dtype is not None:
            try:
                cfg = json.loads(dst.read_text())
            except ValueError:
                cfg = None
            if isinstance(cfg, dict):
                for key in ("dtype", "torch_dtype"):
                    if key in cfg:
                        cfg[key] = dtype
                dst.write_text(json.dumps(cfg, indent=2) + "\n")
        copied.append(dst)
    return copied


def _record(job: Job, config: Options, shards: list[Path], seconds: float) -> dict[str, Any]:
    record: dict[str, Any] = {
        "gradmerge_version": __version__,
        "torch_version": torch.__version__,
        "command": job.command,
        "method": getattr(config, "method", None),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": config.to_dict(),
    }
    if isinstance(config, MergeConfig):
        record["effective_alphas"] = config.alphas
    record["inputs"] = {
        name: {
            "path": str(c.path),
            "files": [f.name for f in c.files],
            "fingerprint_sha256": _weight_sample.content_hash(c.keys(), c.shape, c.dtype, c.rows),
            "fingerprint_of": _weight_sample.CONTENT_HASH_OF,
            "header_sha256": c.fingerprint,
            "tensor_bytes": c.total_bytes,
        }
        for name, c in job.checkpoints.items()
    }
    record["curvatures"] = {
        name: {
            "path": str(f.path),
            "structure": f.structure,
            "layout_fingerprint_sha256": f.fingerprint,
            "dtype": f.metadata.get("dtype"),
            "info": f.info,
        }
        for name, f in job.curvatures.items()
    }
    plan = job.plan
    record["output"] = {
        "files": [p.name for p in shards],
        "dtype": config.dtype or "as in the base",
        "tensors": len(plan.shapes),
        "merged": len(plan.merged),
        "copied_from_base": len(plan.copied),
        "units": len(plan.units),
        "largest_unit": list(plan.largest_unit.keys),
    }
    record["compute"] = {"device": str(job.device), "dtype": config.compute_dtype}
    if job.rounding is not None and job.rounding.unmeasured == 0:
        record["rounding"] = {
            "bound": job.rounding.bound,
            "relative_to_task_vector": job.rounding.ratio,
            "max_amplification": job.rounding.max_ratio,
        }
    if job.step is not None:
        record["step"] = {
            "norm": math.sqrt(job.step.step_sq),
            "relative_to": job.step.reference,
            "ratio": job.step.ratio if math.isfinite(job.step.ratio) else None,
        }
    if job.solves:  # each solved block's method, CG iterations and relative residual
        record["max_residual"] = job.max_residual
        record["solves"] = job.solves
    record["seconds"] = round(seconds, 3)
    return record
