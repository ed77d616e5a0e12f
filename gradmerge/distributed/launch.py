"""``torchrun ... -m gradmerge.distributed curvature|merge|remove ...``: the commands, distributed.

``curvature MODEL DATA OUT`` — data-parallel curvature estimation; the same as
``torchrun --nproc-per-node N --no-python gradmerge curvature MODEL DATA OUT --distributed``
(:func:`add_distributed_options` gives ``gradmerge curvature`` the flag; both run
:func:`run_curvature`).

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

Devices (curvature): ``--device auto`` uses ``cuda:LOCAL_RANK`` (one GPU per rank, NCCL for the sums and a
gloo group for the control messages) when CUDA is available, else the CPU (gloo).

Example:
    torchrun --nproc-per-node 4 -m gradmerge.distributed curvature runs/ft-task-a \\
        data/task_a.safetensors task_a.curvature.safetensors --structure kfac --shift-labels
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradmerge.distributed.comm import Comm
from gradmerge.distributed.errors import DistributedError
from gradmerge.distributed.estimate import DEFAULT_TIMEOUT, estimate_curvature
from gradmerge.distributed.shard import shard


def build_parser() -> argparse.ArgumentParser:
    """``gradmerge curvature``'s parser under ``curvature`` (always distributed), and merge/remove."""
    from gradmerge.commands import curvature

    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m gradmerge.distributed",
        description="Data-parallel gradmerge commands (launch with torchrun).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    curvature.add_parser(sub)  # with the options of add_distributed_options
    p = sub.choices["curvature"]
    p.epilog = (
        "examples (every rank keeps its contiguous part of the batches):\n"
        "  torchrun --nproc-per-node 4 -m gradmerge.distributed curvature runs/ft-task-a \\\n"
        "      data/task_a.safetensors task_a.curvature.safetensors --structure kfac "
        "--shift-labels\n"
        "  torchrun --standalone --nproc-per-node 2 -m gradmerge.distributed curvature \\\n"
        "      ./build.py:model ./build.py:batches a.curvature.safetensors --device cpu\n"
    )
    p.set_defaults(run=run_curvature, distributed=True)
    _add_merge_commands(sub)
    return parser


DISTRIBUTED_EPILOG = """\
distributed (data-parallel) estimation, launched by torchrun:
  torchrun --nproc-per-node 4 --no-python gradmerge curvature runs/ft-task-a \\
      data/task_a.safetensors task_a.curvature.safetensors --structure kfac --distributed
  Every rank loads MODEL and DATA, keeps its contiguous part of the batches, estimates on it; the
  sums are all-reduced, so OUT equals the single-process estimate on all of DATA (to rounding;
  with --fisher mc each rank draws with its own seed). Rank 0 writes OUT, only when every rank
  succeeded; on any failure every rank prints the same error and exits 1, within --timeout.
  --device auto uses cuda:LOCAL_RANK (NCCL sums) when CUDA is available, else the CPU (gloo).
"""


def add_distributed_options(p: argparse.ArgumentParser) -> None:
    """``--distributed`` and its options (``--timeout``, ``--expected-examples``, ``--backend``).

    Used by ``gradmerge curvature`` (:mod:`gradmerge.commands.curvature`) and by this module's
    ``curvature`` command, where ``--distributed`` is implied.
    """
    p.add_argument(
        "--distributed",
        action="store_true",
        help="data-parallel estimation over the ranks of torchrun (see below)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a rank waits for the others before failing (default 1800; --distributed)",
    )
    p.add_argument(
        "--expected-examples",
        type=int,
        default=None,
        help="fail unless the ranks saw this many examples in all (--distributed)",
    )
    p.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="collective backend of the sums (--distributed; default: gloo on CPU, NCCL on CUDA)",
    )


def check_distributed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors for the distributed options: used without --distributed, or not torchrun."""
    if not args.distributed:
        used = [
            name
            for name, value, default in (
                ("--timeout", args.timeout, None),
                ("--expected-examples", args.expected_examples, None),
                ("--backend", args.backend, "auto"),
            )
            if value != default
        ]
        if used:
            parser.error(f"{', '.join(used)} apply only with --distributed")
        return
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if not dist.is_initialized() and ("RANK" not in os.environ or "WORLD_SIZE" not in os.environ):
        parser.error(
            "--distributed runs under torchrun (RANK/WORLD_SIZE are not set), e.g. "
            "torchrun --nproc-per-node 2 --no-python gradmerge curvature MODEL DATA OUT "
            "--distributed"
        )


def _add_merge_commands(sub: Any) -> None:
    """``merge`` and ``remove``: the single-process commands' parsers, with ``--timeout``."""
    from gradmerge.commands import merge, remove

    for name, module, run in (
        ("merge", merge, run_merge_command),
        ("remove", remove, run_remove_command),
    ):
        module.add_parser(sub)
        p = sub.choices[name]
        p.add_argument(
            "--timeout",
            type=float,
            default=DEFAULT_TIMEOUT.total_seconds(),
            help="seconds a rank waits for the others before failing (default 1800)",
        )
        p.set_defaults(run=run)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m gradmerge.distributed`` (under torchrun)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check = getattr(args, "check", None)
    if check is not None:
        check(parser, args)
    return int(args.run(args))


def run_curvature(args: argparse.Namespace) -> int:
    """Estimate on this rank's shard, sum over the ranks, write OUT on rank 0. 0 on success.

    What ``gradmerge curvature --distributed`` and ``-m gradmerge.distributed curvature`` run;
    ``args`` are that parser's (:func:`add_distributed_options` included).
    """
    from gradmerge.commands import curvature as command

    start = time.perf_counter()
    if getattr(args, "timeout", None) is None:
        args.timeout = DEFAULT_TIMEOUT.total_seconds()
    device = _device(args.device)
    created = _init(args.backend, device, args.timeout)
    rank = dist.get_rank()
    try:
        model = command.load_model(args.model).to(device).eval()
        data: Any = command.load_data(
            args.data,
            batch_size=args.batch_size or 16,
            shift_labels=args.shift_labels,
            ignore_index=args.ignore_index,
        )
        if rank == 0:
            command.warn_unshifted(model, data, shift_labels=args.shift_labels)
        data = shard(data)
        if rank == 0 and not args.no_progress:
            data = command.progress(data, f"{args.structure} {args.fisher} (rank 0)")
        curvature = estimate_curvature(
            model,
            data,
            timeout=args.timeout,
            expected_examples=args.expected_examples,
            **command.estimate_options(args),
        )
        curvature.meta.update(command.provenance(args, device))
        _write_on_rank0(curvature, args.out, args.timeout)
    except DistributedError as err:
        print(f"gradmerge.distributed: rank {rank}: error: {err}", file=sys.stderr)
        return 1
    finally:
        if created:
            dist.destroy_process_group()
    if rank == 0:
        print(
            f"wrote {args.out}: {args.structure} {args.fisher} curvature, a sum over "
            f"{curvature.meta['num_examples']} examples on {curvature.meta['ranks']} ranks "
            f"({time.perf_counter() - start:.1f} s)"
        )
    return 0


def run_merge_command(args: argparse.Namespace) -> int:
    """``merge CONFIG OUT_DIR`` over the ranks; 0 on success, 1 on failure (on every rank)."""
    from gradmerge.checkpoints import MergeConfig, plan_merge
    from gradmerge.distributed.merge import run_merge

    return _run_streaming(args, "merge", MergeConfig.from_yaml, plan_merge, run_merge)


def run_remove_command(args: argparse.Namespace) -> int:
    """``remove CONFIG OUT_DIR`` over the ranks; as :func:`run_merge_command`."""
    from gradmerge.checkpoints import RemoveConfig, plan_remove
    from gradmerge.distributed.merge import run_remove

    return _run_streaming(args, "remove", RemoveConfig.from_yaml, plan_remove, run_remove)


def _run_streaming(args: argparse.Namespace, command: str, load: Any, plan: Any, run: Any) -> int:
    """The single-process command's driver (messages, --dry-run) around the distributed run."""
    import contextlib
    import io

    from gradmerge.commands.merge import run_command

    created = _init("gloo", torch.device("cpu"), args.timeout)
    try:

        def execute(config: Any, out_dir: str, *, overwrite: bool, progress: bool) -> Any:
            return run(config, out_dir, overwrite=overwrite, timeout=args.timeout)

        if dist.get_rank() == 0:
            return run_command(args, command, load, plan, execute)
        with contextlib.redirect_stdout(io.StringIO()):  # rank 0 prints the summary
            return run_command(args, command, load, plan, execute)
    finally:
        if created:
            dist.destroy_process_group()


def _write_on_rank0(curvature: Any, out: str, timeout: float) -> None:
    """Rank 0 writes ``out`` (atomically); every rank learns whether it worked."""
    failure = None
    if dist.get_rank() == 0:
        try:
            curvature.save(out)
        except Exception as err:
            failure = f"{type(err).__name__}: {err}"
    with Comm.open(None, timeout) as comm:
        failures = comm.exchange("finish writing", failure)
    if failures[0] is not None:
        raise DistributedError(f"rank 0 could not write {out}: {failures[0]}", {0: failures[0]})


def _device(choice: str) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _init(backend: str, device: torch.device, timeout: float) -> bool:
    """Initialise the default process group from torchrun's environment; False if it was."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit(
            "gradmerge.distributed: RANK/WORLD_SIZE are not set: launch with torchrun, e.g. "
            "torchrun --nproc-per-node 2 -m gradmerge.distributed curvature MODEL DATA OUT"
        )
    if backend == "auto":
        backend = "gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout))
    return True
