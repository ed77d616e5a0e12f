"""``gradmerge demo``: the end-to-end merging and removal study on scikit-learn's digits."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from gradmerge.commands._flags import DEVICE, OVERWRITE

DEFAULT_OUT = "runs/demo"


def add_parser(sub: Any) -> None:
    """Register ``gradmerge demo``."""
    p = sub.add_parser(
        "demo",
        help="merge and un-merge fine-tuned MLPs on real data (digits): table, JSON and plots",
        description="Fine-tune an MLP on domain-shifted handwritten digits (scikit-learn's, no\n"
        "download); estimate diagonal, K-FAC and full curvature; merge with task arithmetic,\n"
        "Fisher averaging, RegMean and gradient matching (Eq. 6) and compare with the model\n"
        "trained on all tasks; remove one task with Eq. 13 and with Koh & Liang against\n"
        "retraining. Prints the tables; writes results.json, table.txt and PNG plots to --out\n"
        "(all at once: a failed run leaves no half-written directory). Uses a GPU if present.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  gradmerge demo\n  gradmerge demo --out runs/demo2 --seed 1\n"
        "  gradmerge demo --quick --out /tmp/demo --overwrite",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default=DEFAULT_OUT,
        help=f"output directory, new or empty unless --overwrite ({DEFAULT_OUT})",
    )
    OVERWRITE.add(p, what="a non-empty --out")
    p.add_argument(
        "--seed", type=int, default=0, help="data split and initialisation (%(default)s)"
    )
    p.add_argument("--quick", action="store_true", help="a small version (seconds)")
    DEVICE.add(p)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: fastest for these small matrices, and on a busy machine)",
    )
    p.set_defaults(run=run, check=check, writes=writes)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject an unusable --seed or --threads before any work (exit 2 with usage); --out is
    the output guard's (:func:`writes`)."""
    if args.seed < 0:
        parser.error(f"--seed must be 0 or more, got {args.seed}")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")


def writes(args: argparse.Namespace) -> Any:
    """The output guard's declaration: the folder --out; the study reads no file."""
    from pathlib import Path

    from gradmerge.commands._writes import Writes
    from gradmerge.foundation.guard import Output

    return Writes([Output("--out", Path(args.out), "folder")], [])


def run(args: argparse.Namespace) -> int:
    """Run the study, print its tables; 1 when it fails (an unusable --device, an --out that
    could not be written: one line of stderr, as the other commands)."""
    from gradmerge.demo import run_demo
    from gradmerge.errors import GradmergeError

    start = time.perf_counter()
    print(
        f"gradmerge demo{' --quick' if args.quick else ''}: merging and removal on "
        "scikit-learn's digits (seed {})\n".format(args.seed),
        flush=True,
    )
    try:
        results = run_demo(
            args.out,
            quick=args.quick,
            device=args.device,
            seed=args.seed,
            overwrite=args.overwrite,
            threads=args.threads,
            log=lambda line: print(line, flush=True),
        )
    except (GradmergeError, OSError) as error:
        print(f"gradmerge demo: error: {error}", file=sys.stderr)
        return 1
    print("\n" + results.summary())
    print(f"\ndone in {time.perf_counter() - start:.1f} s")
    return 0
