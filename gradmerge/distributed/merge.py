r"""Distributed merging and removal: the streaming engine's units split over ranks, one index at the
end.

The single-process engine (:mod:`gradmerge.jobs.engine`) processes the plan's units — the
smallest groups of tensors some curvature couples — one after another and appends the results to
safetensors shards. Here every rank opens the same inputs (on a filesystem all ranks share), builds
the same plan, and processes a contiguous block of units, balanced by output bytes:

    unit u goes to rank ⌊R · (B_<u + b_u / 2) / B⌋,

with b_u the unit's output bytes, B_<u those of the units before it and B the total. Each rank
writes its units with the engine's own unit computation and shard writer (so every tensor is
BIT-EQUAL to the single-process merge's: the same arithmetic on the same device and dtype) into
its own shards; the shards are then numbered in rank order, ``model-0000k-of-0000N.safetensors``,
and rank 0 writes the one ``model.safetensors.index.json``, the base's config/tokenizer files and
the ``gradmerge_merge.json`` record (with a ``distributed`` entry: ranks, units and bytes per rank).
With one rank the output is the single-process output, file for file. Tensors stay in the base's
storage order across the shards.

Parallelism is over units: a dense curvature over the whole model is one unit, done by one rank.

Failure. The output is built in a hidden staging folder beside ``out_dir`` (made by rank 0) and
renamed into place only when every rank succeeded; on any failure every rank raises
:class:`DistributedError` (naming the failing rank and its error) and rank 0 removes the staging
folder, so no partial output appears. The ranks must agree on the configuration, the plan and the
inputs' fingerprints before anything is written, and no rank waits for the others longer than
``timeout`` (:mod:`gradmerge.distributed.comm`). A rank killed outright can leave the hidden
staging folder behind, as a killed single-process run does.

Usage, in a script run by ``torchrun --nproc-per-node 4 script.py``::

    import torch.distributed as dist
    from gradmerge.jobs import MergeConfig
    from gradmerge.distributed.merge import run_merge
    dist.init_process_group("gloo")
    report = run_merge(MergeConfig.from_yaml("merge.yaml"), "merged/")   # the same on every rank
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from gradmerge.distributed.comm import Comm
from gradmerge.distributed.errors import DistributedError
from gradmerge.distributed.estimate import DEFAULT_TIMEOUT
from gradmerge.foundation.files import temp_dir_beside
from gradmerge.foundation.guard import Output, publish_folder, refuse_existing
from gradmerge.io import open_checkpoint
from gradmerge.io.writer import INDEX_NAME, ShardedWriter
from gradmerge.jobs import MergeConfig, MergeReport, RemoveConfig
from gradmerge.jobs.engine import check_output
from gradmerge.jobs.job import Job
from gradmerge.jobs.opening import open_job
from gradmerge.jobs.plan import Plan, Unit


def run_merge(
    config: MergeConfig,
    out_dir: str | os.PathLike[str],
    *,
    group: Any = None,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    overwrite: bool = False,
) -> MergeReport:
    """:func:`gradmerge.jobs.run_merge` over the ranks of ``group`` (module docstring).

    Every rank calls it with the same ``config`` and ``out_dir``; every rank returns the same
    report (``seconds`` aside), whose ``bytes_read``/``bytes_written`` are totals over the ranks.

    Raises:
        DistributedError: on every rank, when a rank failed (its error is named: a singular
            system, a bad input, an existing ``out_dir`` without ``overwrite``, ...), when the
            ranks disagree on the configuration, the inputs or the plan, when ``out_dir`` is not
            on a filesystem every rank sees, or when the others do not answer within ``timeout``.
    """
    return _run("merge", config, out_dir, group, timeout, overwrite)


def run_remove(
    config: RemoveConfig,
    out_dir: str | os.PathLike[str],
    *,
    group: Any = None,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    overwrite: bool = False,
) -> MergeReport:
    """:func:`gradmerge.jobs.run_remove` over the ranks of ``group``; as :func:`run_merge`."""
    return _run("remove", config, out_dir, group, timeout, overwrite)


def assign_units(plan: Plan, world_size: int) -> list[list[Unit]]:
    """Contiguous blocks of the plan's units, one per rank, balanced by output bytes."""
    sizes = [_unit_bytes(plan, u) for u in plan.units]
    total = max(sum(sizes), 1)
    blocks: list[list[Unit]] = [[] for _ in range(world_size)]
    before = 0
    for unit, size in zip(plan.units, sizes, strict=True):
        rank = min(world_size - 1, int(world_size * (before + size / 2) / total))
        blocks[rank].append(unit)
        before += size
    return blocks


def shard_names(counts: list[int]) -> list[list[str]]:
    """Global shard file names per rank, from each rank's number of shards (rank order)."""
    n = sum(counts)
    names = [
        "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        for i in range(n)
    ]
    out, start = [], 0
    for c in counts:
        out.append(names[start : start + c])
        start += c
    return out


# ----- the run ------------------------------------------------------------------------------------
def _run(
    command: str,
    config: Any,
    out_dir: str | os.PathLike[str],
    group: Any,
    timeout: float | timedelta,
    overwrite: bool,
) -> MergeReport:
    start = time.perf_counter()
    target = Path(out_dir).absolute()
    with Comm.open(group, timeout) as comm, ExitStack() as stack:
        step = _Steps(comm)
        # 1. Open the inputs and plan; every rank must see the same.
        job = step.run("plan", lambda: _open(config, target, overwrite, stack))
        summaries = step.exchange("agree on the plan", lambda: _summary(job, config))
        _check_same_plan(summaries)
        # 2. Rank 0 makes the staging folder; every rank must see it.
        made = step.exchange(
            "create the staging folder",
            lambda: str(_make_stage(target, overwrite)) if comm.rank == 0 else None,
        )
        stage = Path(made[0])
        with _removed_on_failure(stage, comm.rank == 0):
            step.exchange("find the staging folder", lambda: _check_shared(stage, comm.rank))
            # 3. Each rank writes its units into stage/.rank{r}/.
            mine = assign_units(job.plan, comm.world_size)[comm.rank]
            local = stage / f".rank{comm.rank:05d}"
            written = step.exchange(
                "write their shards", lambda: _write(job, mine, local, config.max_shard_size)
            )
            if job.step is not None:  # a removal: its step summed over the ranks, then checked
                job.step.step_sq = sum(w["step"][0] for w in written)
                job.step.reference_sq = sum(w["step"][1] for w in written)
                step.run(
                    "check the removal's step",
                    lambda: job.step.check(config.step_check, config.max_relative_step),
                )
            # 4. Number the shards in rank order; rank 0 writes the index, assets and record.
            names = shard_names([len(w["files"]) for w in written])
            step.exchange(
                "name their shards", lambda: _rename(local, written[comm.rank], names[comm.rank])
            )
            files = step.exchange(
                "finish the output",
                lambda: (
                    _finish(job, config, stage, written, names, comm.world_size, start)
                    if comm.rank == 0
                    else None
                ),
            )[0]
            # 5. Rank 0 moves the output into place.
            step.exchange(
                "move the output into place",
                lambda: publish_folder(stage, target, overwrite) if comm.rank == 0 else None,
            )
    plan = job.plan
    return MergeReport(
        out_dir=target,
        files=tuple(target / n for n in files),
        tensors=len(plan.shapes),
        merged=len(plan.merged),
        copied=len(plan.copied),
        units=len(plan.units),
        bytes_read=sum(w["bytes_read"] for w in written),
        bytes_written=sum(w["bytes_written"] for w in written),
        seconds=time.perf_counter() - start,
        device=str(job.device),
        notes=(job.step.describe(),) if job.step is not None else (),
    )


class _Steps:
    """Run a step on this rank, then exchange its result or failure with every rank."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._pending: tuple[str, Exception] | None = None

    def run(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` on this rank; a failure is held until the next :meth:`exchange`."""
        try:
            return fn()
        except Exception as err:
            self._pending = (what, err)
            return None

    def exchange(self, phase: str, fn: Callable[[], Any]) -> list[Any]:
        """Every rank's ``fn()`` result, or :class:`DistributedError` on every rank."""
        pending, self._pending = self._pending, None
        failure: str | None = None
        cause: Exception | None = None
        value = None
        if pending is not None:
            failure, cause = f"{type(pending[1]).__name__}: {pending[1]}", pending[1]
        else:
            try:
                value = fn()
            except Exception as err:
                failure, cause = f"{type(err).__name__}: {err}", err
        gathered = self.comm.exchange(phase, (failure, value))
        failed = {r: f for r, (f, _) in enumerate(gathered) if f is not None}
        if failed:
            lines = "; ".join(f"rank {r}: {f}" for r, f in failed.items())
            raise DistributedError(
                f"{len(failed)} of {len(gathered)} ranks failed to {phase}: {lines}", failed
            ) from cause
        return [v for _, v in gathered]


def _open(config: Any, target: Path, overwrite: bool, stack: ExitStack) -> Job:
    check_output(config, target, overwrite=overwrite)  # the guard, before any input is opened
    return open_job(config, stack)


def _summary(job: Job, config: Any) -> dict[str, Any]:
    """What every rank must agree on: the configuration, the inputs and the plan."""
    plan = job.plan
    return {
        "config": config.to_dict(),
        "inputs": {name: c.fingerprint for name, c in job.checkpoints.items()},
        "curvatures": {name: f.fingerprint for name, f in job.curvatures.items()},
        "units": [(u.keys, u.merged) for u in plan.units],
        "tensors": {k: (tuple(s), str(plan.out_dtypes[k])) for k, s in plan.shapes.items()},
    }


def _check_same_plan(summaries: list[dict[str, Any]]) -> None:
    ref = summaries[0]
    for r, summary in enumerate(summaries[1:], start=1):
        diff = [k for k in ref if summary[k] != ref[k]]
        if diff:
            raise DistributedError(
                f"rank {r} and rank 0 disagree on the {', '.join(diff)} of the run: every rank "
                "must be given the same configuration and see the same input files (a shared "
                "filesystem)"
            )


def _make_stage(target: Path, overwrite: bool) -> Path:
    """Rank 0: the hidden staging folder beside ``target`` (refusing an existing ``target``)."""
    refuse_existing(Output("OUT_DIR", target, "folder"), overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    return temp_dir_beside(target, "gradmerge")


def _check_shared(stage: Path, rank: int) -> None:
    if not stage.is_dir():
        raise DistributedError(
            f"rank {rank} cannot see the staging folder {stage} that rank 0 made: out_dir must "
            "be on a filesystem every rank shares"
        )


def _write(job: Job, units: list[Unit], folder: Path, max_shard_size: int) -> dict[str, Any]:
    """This rank's units, computed by the engine and written by its shard writer into ``folder``."""
    folder.mkdir()
    plan = job.plan
    entries = [(k, plan.shapes[k], plan.out_dtypes[k]) for u in units for k in u.keys]
    writer = ShardedWriter(folder, entries, max_shard_size)
    try:
        for unit in units:
            out = job.compute_unit(unit)
            for k in unit.keys:
                writer.write(k, out[k])
        written = writer.finish()
    finally:
        writer.abort()
    shards = [p for p in written if p.name != INDEX_NAME]
    weight_map: dict[str, str] = {}
    if shards:
        with open_checkpoint(folder) as ckpt:
            weight_map = {k: ckpt.file_of(k).name for k in ckpt}
    bytes_read = job.bytes_read
    return {
        "files": [p.name for p in shards],
        "weight_map": weight_map,
        "units": len(units),
        "tensor_bytes": sum(math.prod(s) * d.itemsize for _, s, d in entries),
        "bytes_written": writer.bytes_written,
        "bytes_read": bytes_read,
        "step": (job.step.step_sq, job.step.reference_sq) if job.step is not None else None,
        "zero_blocks": dict(job.zero_blocks),
        "steps": dict(job.steps),
    }


def _rename(folder: Path, written: dict[str, Any], names: list[str]) -> None:
    """Move this rank's shards to their global names in the staging folder."""
    for local, name in zip(written["files"], names, strict=True):
        os.replace(folder / local, folder.parent / name)
    shutil.rmtree(folder)


def _finish(
    job: Job,
    config: Any,
    stage: Path,
    written: list[dict[str, Any]],
    names: list[list[str]],
    world_size: int,
    start: float,
) -> list[str]:
    """Rank 0: the index (several shards), the base's assets, the record and the model card.
    The files' names."""
    shards = [n for per_rank in names for n in per_rank]
    files = list(shards)
    if len(shards) > 1:
        weight_map = {}
        for w, global_names in zip(written, names, strict=True):
            rename = dict(zip(w["files"], global_names, strict=True))
            weight_map.update({k: rename[f] for k, f in w["weight_map"].items()})
        ordered = {k: weight_map[k] for u in job.plan.units for k in u.keys}
        index = {
            "metadata": {"total_size": sum(w["tensor_bytes"] for w in written)},
            "weight_map": ordered,
        }
        (stage / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        files.append(INDEX_NAME)
    assets = job.copy_assets(stage, config.dtype)
    for rank, w in enumerate(written):  # the tensors each other rank found untouched
        if rank != 0:
            job.add_counts(w["zero_blocks"], w["steps"])
    record = job.record(config, [stage / n for n in shards], time.perf_counter() - start)
    record["distributed"] = {
        "ranks": world_size,
        "units_per_rank": [w["units"] for w in written],
        "tensor_bytes_per_rank": [w["tensor_bytes"] for w in written],
        "bytes_read_per_rank": [w["bytes_read"] for w in written],
    }
    name = f"gradmerge_{job.command}.json"
    (stage / name).write_text(json.dumps(record, indent=2) + "\n")
    readme = job.write_card(stage, config, record)
    return [*files, *(a.name for a in assets), name, readme.name]


@contextmanager
def _removed_on_failure(stage: Path, owner: bool) -> Iterator[None]:
    """On an exception, the owner (rank 0) removes the staging folder: no partial output."""
    try:
        yield
    except BaseException:
        if owner:
            shutil.rmtree(stage, ignore_errors=True)
        raise


def _unit_bytes(plan: Plan, unit: Unit) -> int:
    return sum(math.prod(plan.shapes[k]) * plan.out_dtypes[k].itemsize for k in unit.keys)


__all__ = ["assign_units", "run_merge", "run_remove", "shard_names"]
