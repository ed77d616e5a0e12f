"""The streaming engine: ``run_merge`` and ``run_remove`` over checkpoint files.

For every unit of the plan (:mod:`gradmerge.jobs.plan`: the smallest group of tensors some
curvature couples) the engine reads that unit's tensors from every input — base, fine-tuned
models, the unit's part of each curvature file, the gradient — on the chosen device in the
compute dtype, calls the pure rule of :mod:`gradmerge.merge` on these sub-dicts
(each method's rule, :mod:`gradmerge.methods`), casts the result to the output dtype and appends it
to the output shards. Peak memory is a few units' tensors: the inputs are memory-mapped and read one
unit at a time, the output is written as it comes. A tensor larger than
:data:`~gradmerge.jobs.job.ROW_BLOCK_BYTES` (in the compute dtype) that its method merges
elementwise — task arithmetic, and Fisher averaging and gradient matching where its curvatures
are diagonal or δ·I — is read, merged and written a block of rows at a time
(:meth:`~gradmerge.jobs.job.Job.row_blocks`), so that peak memory stays bounded whatever the
tensor's size and dtype: a 128k-token bfloat16 embedding would otherwise be read as several
float32 copies of the whole matrix. The result is the same bit for bit. A dense curvature couples
every parameter it covers, so with one the whole model is a single unit (and must fit in memory).

The output folder appears only when everything succeeded (:func:`staged_output`); it holds the
shards, the base's config and tokenizer files (``dtype`` in config.json updated), a model card
(README.md, :mod:`gradmerge.jobs.card`; never the base's own) and a record,
``gradmerge_merge.json`` / ``gradmerge_remove.json``: method, α, prior, dtypes, device, gradmerge
and torch versions, each input's fingerprint (a SHA-256 content hash of its values, exact on
every small tensor and on 16 evenly spaced rows of every large one:
:func:`gradmerge.io.fingerprint.content_hash`; and of its safetensors headers) and each curvature
file's metadata.

The same steps are public for drivers that split the work (:mod:`gradmerge.distributed.merge`
gives each rank its own units): :func:`~gradmerge.jobs.opening.open_job` opens the inputs and
builds the plan, :meth:`Job.compute_unit` computes one unit's output tensors,
:func:`check_output` refuses an output folder the guard refuses (:mod:`gradmerge.foundation.guard`:
one that is, lies inside or holds an input), :meth:`Job.copy_assets`, :meth:`Job.record` and
:meth:`Job.write_card` finish the output folder. :func:`run_merge` is these steps with one
:class:`ShardedWriter` in a staged folder.

This module is the driver: the pass over the units and their blocks of rows into a staged folder,
the one error naming every singular unit, and the :class:`MergeReport`. Its parts:
:mod:`gradmerge.jobs.opening` (the inputs, their checks, the plan and the unit function),
:mod:`gradmerge.jobs.job` (:class:`Job`: one unit's computation, the record and the assets) and
:mod:`gradmerge.jobs.removal_checks` (a removal's step size and rounding bound). ``open_job`` and
``Job`` are importable from here too, as the steps above.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from gradmerge.errors import PD_FIX, NotPositiveDefiniteError
from gradmerge.foundation import guard
from gradmerge.foundation.guard import Output
from gradmerge.foundation.text import key_list
from gradmerge.io.writer import ShardedWriter, remove_stale_stages, staged_output
from gradmerge.jobs.background import Background
from gradmerge.jobs.config import MergeConfig, RemoveConfig
from gradmerge.jobs.job import Job
from gradmerge.jobs.opening import open_job, open_merge, open_remove
from gradmerge.jobs.options import Options
from gradmerge.jobs.plan import Plan, Unit
from gradmerge.jobs.progress import Progress
from gradmerge.kernels import memory

__all__ = [
    "Job",
    "MergeReport",
    "check_output",
    "open_job",
    "plan_merge",
    "plan_remove",
    "run_merge",
    "run_remove",
]

WRITES_PENDING = 2
"""How many steps' outputs may wait for the writing thread (:mod:`gradmerge.jobs.background`)
before the pass waits for it: the memory held for outputs is bounded by this many steps'. An
output's memory serves a later output of its size (:func:`gradmerge.kernels.memory.recycling`)
once its write is done, so with writes pending the reuse depends on the thread's timing; ``0``
writes on the pass's own thread (each output written and dropped before the next is made)."""

READAHEAD_STEPS = 2
"""How many steps (units, or row blocks of one) ahead of the one computing the disk is asked to
read (:meth:`Job.prefetch`): with one, the disk idles whenever a step computes longer than the
next one takes to read; two keep it busy (at most two steps' inputs wait in the page cache)."""


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
        notes: lines for the user, e.g. a removal's step size
            (:class:`~gradmerge.jobs.removal_checks.StepSize`).
        solves: per solved block (a K-FAC layer, or a unit's name), how its system was solved:
            ``{"method", "iterations", "residual", "result", "success"}`` (also in the record, under
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
            written (:func:`check_output`, :mod:`gradmerge.foundation.guard`).
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
        job = open_merge(config, stack)
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
        job = open_remove(config, stack)
        return _execute(job, config, out_dir, overwrite, progress, start, snapshot)


def plan_merge(config: MergeConfig) -> Plan:
    """Check the inputs of a merge and return its plan, reading no tensor (``--dry-run``)."""
    with ExitStack() as stack:
        return open_merge(config, stack).plan


def plan_remove(config: RemoveConfig) -> Plan:
    """Check the inputs of a removal and return its plan, reading no tensor (``--dry-run``)."""
    with ExitStack() as stack:
        return open_remove(config, stack).plan


# ----- execution: units → shards, in a staged folder ----------------------------------------------
def _execute(
    job: Job,
    config: Options,
    out_dir: str | os.PathLike[str],
    overwrite: bool,
    progress: bool,
    start: float,
    snapshot: guard.Snapshot,
) -> MergeReport:
    target = Path(out_dir).absolute()
    plan = job.plan
    entries = [(k, plan.shapes[k], plan.out_dtypes[k]) for u in plan.units for k in u.keys]
    bar = _progress(progress, plan.out_bytes(), job.command, len(entries))
    removed, left = remove_stale_stages(target)
    with (
        staged_output(target, overwrite=overwrite) as stage,
        memory.recycling(),  # an output written and dropped gives its memory to a later one
        Background(depth=1) as hashing,  # the inputs' fingerprints, beside the pass
        Background(depth=WRITES_PENDING) as writing,  # outputs written while the next computes
    ):
        fingerprints = hashing.submit(job.fingerprints)
        writer = ShardedWriter(stage, entries, config.max_shard_size)
        try:
            singular: list[tuple[Unit, NotPositiveDefiniteError]] = []
            steps = [(unit, rows) for unit in plan.units for rows in job.row_blocks(unit)]
            found: list[NotPositiveDefiniteError] = []  # the current unit's singular blocks
            for step in steps[:READAHEAD_STEPS]:
                job.prefetch(*step)
            for i, (unit, rows) in enumerate(steps):
                if i + READAHEAD_STEPS < len(steps):  # the disk reads ahead while this computes
                    job.prefetch(*steps[i + READAHEAD_STEPS])
                try:
                    out = job.compute_unit(unit, rows)
                except NotPositiveDefiniteError as err:
                    # go on checking the other units (and blocks), so that one run names every
                    # unit that needs damping; nothing more is written, and nothing is published
                    found.append(err)
                else:
                    if not singular and not found:
                        writing.submit(_write, writer, bar, out, rows, plan)
                    del out
                if found and (i + 1 == len(steps) or steps[i + 1][0] is not unit):
                    # the unit's block that needs the most damping speaks for it
                    singular.append((unit, max(found, key=lambda e: e.suggested_delta or 0.0)))
                    found = []
            if singular:
                raise _all_singular(job, singular)
            writing.drain()
            shards = writer.finish()
        finally:
            writing.close()  # no write runs while the shard is closed
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
        facts = job.record(config, shards, seconds, fingerprints.result())
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


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _progress(enabled: bool, total: int, command: str, tensors: int) -> Progress | None:
    """Bytes and tensors written: a bar on a terminal, timed log lines elsewhere."""
    if not enabled:
        return None
    return Progress(f"gradmerge {command}", total, unit="B", items="tensors", items_total=tensors)


def check_output(
    config: MergeConfig | RemoveConfig, out_dir: str | os.PathLike[str], *, overwrite: bool
) -> guard.Snapshot:
    """The output guard (:func:`gradmerge.foundation.guard.check`) for ``out_dir`` against every
    input of ``config`` (:meth:`~gradmerge.jobs.options.FromYaml.inputs`), before any input is
    opened; returns the inputs' :class:`~gradmerge.foundation.guard.Snapshot`, checked again before
    the output is renamed into place.

    Raises:
        OutputOverlapError: ``out_dir`` is, lies inside or contains an input.
        OutputExistsError: ``out_dir`` exists and not ``overwrite``.
        OutputWriteError: ``out_dir`` is a file, lies below one, or its folder is not writable.
    """
    inputs = config.inputs()
    guard.check([Output("OUT_DIR", Path(out_dir), "folder")], inputs, overwrite=overwrite)
    # the files read while the merge runs: not the configuration (read once, before), nor what
    # only the file it was made from names (a remerge's merge YAML and the models it leaves out)
    once = {*config.also_reads}
    return guard.Snapshot.of([i for i in inputs if i.role != "CONFIG" and i not in once])
