"""``torchrun ... -m gradmerge.commands.distributed curvature|merge|remove ...``: the commands,
distributed.

``curvature MODEL DATA OUT`` — data-parallel curvature estimation; the same as
``torchrun --nproc-per-node N --no-python gradmerge curvature MODEL DATA OUT --distributed``
(:func:`gradmerge.commands.curvature.add_distributed_options` gives ``gradmerge curvature`` the
flag; both run :func:`gradmerge.commands.curvature.run_distributed`).

The arguments and options are those of ``gradmerge curvature`` (:mod:`gradmerge.commands.curvature`:
MODEL a Hugging Face folder or an entry point, DATA a tensor file or an entry point), plus
``--timeout`` (seconds a rank waits for the others; default 1800), ``--expected-examples`` (the
total over ranks must equal it) and ``--backend``. Every rank loads the model and the batches, keeps
its contiguous part of the batches (:func:`gradmerge.distributed.shard`), estimates on it, and the
sums are all-reduced (:func:`gradmerge.distributed.estimate_curvature`); rank 0 writes OUT,
atomically, and only when every rank succeeded. On any failure every rank prints the same
explanation and exits with status 1, and OUT is not written.

``merge CONFIG.yaml OUT_DIR`` and ``remove CONFIG.yaml OUT_DIR`` — the arguments of
``gradmerge merge``/``gradmerge remove`` plus ``--timeout``: the plan's units split over the ranks,
each writing its own shards, one index at the end (:mod:`gradmerge.distributed.merge`); the inputs
and OUT_DIR must be on a filesystem every rank shares. The control messages go over gloo.

Devices (curvature): ``--device auto`` uses ``cuda:LOCAL_RANK`` (one GPU per rank, NCCL for the sums
and a gloo group for the control messages) when CUDA is available, else the CPU (gloo).

This module is the command line only: the library it drives is :mod:`gradmerge.distributed`
(estimation, sharding, process groups) and :mod:`gradmerge.io.sources` (MODEL and DATA).

Example:
    torchrun --nproc-per-node 4 -m gradmerge.commands.distributed curvature runs/ft-task-a \\
        data/task_a.safetensors task_a.curvature.safetensors --structure kfac --shift-labels
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradmerge.commands import curvature, merge, remove
from gradmerge.commands._flags import TIMEOUT
from gradmerge.commands._writes import guard
from gradmerge.distributed.errors import DistributedError
from gradmerge.distributed.estimate import DEFAULT_TIMEOUT
from gradmerge.distributed.launch import init_from_env


def build_parser() -> argparse.ArgumentParser:
    """``gradmerge curvature``'s parser under ``curvature`` (always distributed), and
    merge/remove."""
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m gradmerge.commands.distributed",
        description="Data-parallel gradmerge commands (launch with torchrun).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    curvature.add_parser(sub)  # with the options of curvature.add_distributed_options
    p = sub.choices["curvature"]
    p.epilog = (
        "examples (every rank keeps its contiguous part of the batches):\n"
        "  torchrun --nproc-per-node 4 -m gradmerge.commands.distributed curvature runs/ft-task-a \\\n"
        "      data/task_a.safetensors task_a.curvature.safetensors --structure kfac "
        "--shift-labels\n"
        "  torchrun --standalone --nproc-per-node 2 -m gradmerge.commands.distributed curvature \\\n"
        "      ./build.py:model ./build.py:batches a.curvature.safetensors --device cpu\n"
    )
    p.set_defaults(run=curvature.run_distributed, distributed=True)
    _add_merge_commands(sub)
    return parser


def _add_merge_commands(sub: Any) -> None:
    """``merge`` and ``remove``: the single-process commands' parsers, with ``--timeout``."""
    for name, module, run in (
        ("merge", merge, run_merge_command),
        ("remove", remove, run_remove_command),
    ):
        module.add_parser(sub)
        p = sub.choices[name]
        TIMEOUT.add(p, when="")
        p.set_defaults(run=run)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m gradmerge.commands.distributed`` (under torchrun)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check = getattr(args, "check", None)
    if check is not None:
        check(parser, args)
    guard(parser, args)  # the output guard, as in gradmerge.cli.main
    return int(args.run(args))


def run_merge_command(args: argparse.Namespace) -> int:
    """``merge CONFIG OUT_DIR`` over the ranks; 0 on success, 1 on failure (on every rank)."""
    from gradmerge.distributed.merge import run_merge
    from gradmerge.jobs import MergeConfig, plan_merge

    return _run_streaming(args, "merge", MergeConfig.from_yaml, plan_merge, run_merge)


def run_remove_command(args: argparse.Namespace) -> int:
    """``remove CONFIG OUT_DIR`` over the ranks; as :func:`run_merge_command`."""
    from gradmerge.distributed.merge import run_remove
    from gradmerge.jobs import RemoveConfig, plan_remove

    return _run_streaming(args, "remove", RemoveConfig.from_yaml, plan_remove, run_remove)


def _run_streaming(args: argparse.Namespace, command: str, load: Any, plan: Any, run: Any) -> int:
    """The single-process command's driver (messages, --dry-run) around the distributed run."""
    if args.timeout is None:
        args.timeout = DEFAULT_TIMEOUT.total_seconds()
    created = _init("gloo", torch.device("cpu"), args.timeout)
    try:

        def execute(config: Any, out_dir: str, *, overwrite: bool, progress: bool) -> Any:
            return run(config, out_dir, overwrite=overwrite, timeout=args.timeout)

        if dist.get_rank() == 0:
            return merge.run_command(args, command, load, plan, execute)
        with contextlib.redirect_stdout(io.StringIO()):  # rank 0 prints the summary
            return merge.run_command(args, command, load, plan, execute)
    finally:
        if created:
            dist.destroy_process_group()


def _init(backend: str, device: torch.device, timeout: float) -> bool:
    """:func:`gradmerge.distributed.launch.init_from_env`, its error as the command's exit."""
    try:
        return init_from_env(backend, device, timeout)
    except DistributedError as err:
        raise SystemExit(f"gradmerge.distributed: {err}") from err


if __name__ == "__main__":
    sys.exit(main())
