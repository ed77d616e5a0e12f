"""The running job: its opened inputs, its plan, and how to compute one unit (:class:`Job`).

:func:`gradmerge.jobs.opening.open_job` makes a :class:`Job`; a driver computes every unit of
its plan with :meth:`Job.compute_unit` (a tensor larger than :data:`ROW_BLOCK_BYTES` that its
method merges elementwise a block of rows at a time: :meth:`Job.row_blocks`) and finishes the
output folder with :meth:`Job.copy_assets`, :meth:`Job.record` and :meth:`Job.write_card`.
:mod:`gradmerge.jobs.engine` is that driver with one writer, :mod:`gradmerge.distributed.merge`
with one writer per rank. A unit's errors are reworded here into the configuration's terms (the
YAML key to change, ``--dry-run`` to check every unit).
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from gradmerge._version import __version__
from gradmerge.curvature.io import CurvatureFile
from gradmerge.errors import (
    PD_FIX,
    GradmergeError,
    NotConvergedError,
    NotPositiveDefiniteError,
    ResultOverflowError,
    StructureError,
)
from gradmerge.foundation.text import key_list
from gradmerge.io import fingerprint
from gradmerge.io.reader import Checkpoint
from gradmerge.jobs import card
from gradmerge.jobs.config import MergeConfig
from gradmerge.jobs.options import Options
from gradmerge.jobs.plan import Plan, Unit
from gradmerge.jobs.removal_checks import Rounding, StepSize
from gradmerge.solvers.solution import Solution

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


@dataclass
class Job:
    """The opened inputs of a merge or removal, its plan, and how to compute one unit.

    Made by :func:`~gradmerge.jobs.opening.open_job`; valid while the ``ExitStack`` given there is
    open (the inputs are memory-mapped). A driver computes every unit of ``plan.units`` with
    :meth:`compute_unit` and writes the tensors in that order;
    :func:`~gradmerge.jobs.engine.run_merge` does exactly this with one writer,
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
        >>> from gradmerge.jobs.opening import open_job
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
    unchanged: Callable[[Unit], bool] = field(default=lambda unit: False)
    """Whether every model's task vector is exactly zero on a merged unit (read as stored): the
    unit is then copied from the base, and ``--dry-run`` checks no system of it."""
    zero_blocks: dict[str, int] = field(default_factory=dict)
    """Merged tensors whose task vectors all read as exactly zero, copied from the base: how many
    of their steps (the whole tensor, or blocks of rows) were (filled by ``compute``)."""
    steps: dict[str, int] = field(default_factory=dict)
    """How many steps of each merged tensor :meth:`compute_unit` computed."""

    @property
    def untouched(self) -> list[str]:
        """Every tensor copied from the base because no model changes it: the plan's (known from
        the inputs' headers, or checked as read) and those found as read (all of their steps)."""
        found = [
            k
            for u in self.plan.units
            if u.merged
            for k in u.keys
            if 0 < self.steps.get(k, 0) == self.zero_blocks.get(k, 0)
        ]
        return [*self.plan.untouched, *found]

    def add_counts(self, zero_blocks: Mapping[str, int], steps: Mapping[str, int]) -> None:
        """Add another worker's :attr:`zero_blocks` and :attr:`steps` (the ranks of a
        distributed merge, each computing its own units), so that the record names them all."""
        for mine, theirs in ((self.zero_blocks, zero_blocks), (self.steps, steps)):
            for k, n in theirs.items():
                mine[k] = mine.get(k, 0) + n

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
        reading and arithmetic overlap (:mod:`gradmerge.foundation.readahead`; a hint only)."""
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
            if unit.untouched and any(k in self.plan.checked for k in unit.keys):
                _check_untouched(self, unit)
            return _copy_unit(self, unit)
        for k in unit.keys:
            self.steps[k] = self.steps.get(k, 0) + 1
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

    def fingerprints(self) -> dict[str, str]:
        """Each input checkpoint's content hash (:func:`gradmerge.io.fingerprint.content_hash`),
        by input name: a few rows of every large tensor, read apart from the merge's pass."""
        return {
            name: fingerprint.content_hash(c.keys(), c.shape, c.dtype, c.rows)
            for name, c in self.checkpoints.items()
        }

    def record(
        self,
        config: Options,
        shards: list[Path],
        seconds: float,
        fingerprints: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """The ``gradmerge_<command>.json`` record: versions, config, inputs' fingerprints
        (``fingerprints``, when :meth:`fingerprints` was computed already), output."""
        hashes = self.fingerprints() if fingerprints is None else fingerprints
        return _record(self, config, shards, seconds, hashes)

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


def _check_untouched(job: Job, unit: Unit) -> None:
    """Refuse a unit the plan copies because the curvatures restricted to adapters leave it out,
    where a model's tensor differs from the base's (its task vector is not zero there)."""
    for name, ckpt in job.checkpoints.items():
        if name == "base_model":
            continue
        for k in unit.keys:
            if not torch.equal(ckpt.get(k), job.base.get(k)):
                raise StructureError(
                    f"{name} ({ckpt.path}) changes {k!r}, which the curvatures restricted to a "
                    "LoRA adapter's parameters leave out: a curvature is needed wherever a model "
                    "changes the base. Estimate them with `gradmerge curvature ... "
                    "--whole-model`, or merge the adapter folders themselves"
                )


def _copy_unit(job: Job, unit: Unit) -> dict[str, Tensor]:
    return {k: job.base.get(k, dtype=job.plan.out_dtypes[k]) for k in unit.keys}


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


def _untouched_record(job: Job) -> dict[str, Any]:
    """The record's account of the tensors copied from the base because every model's task
    vector is exactly zero there (among ``copied_from_base``, or found among the merged)."""
    names = job.untouched
    return {
        "tensors": len(names),
        "names": names,
        "rule": "every model's task vector is exactly zero on these tensors (and no curvature "
        "couples them to others): each method's result there is the base, copied before any "
        "curvature is read or system solved",
    }


def _record(
    job: Job, config: Options, shards: list[Path], seconds: float, hashes: Mapping[str, str]
) -> dict[str, Any]:
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
            "fingerprint_sha256": hashes[name],
            "fingerprint_of": fingerprint.CONTENT_HASH_OF,
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
        "untouched": _untouched_record(job),
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
