"""``gradmerge verify``: check every derivation of the appendix, statement by statement."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    """Register ``gradmerge verify``."""
    p = sub.add_parser(
        "verify",
        help="check every derivation of the paper's appendix (symbolic and numeric)",
        description="Check every derivation of the appendix: sympy identities and float64 checks "
        "on exact linear and logistic models. Exits 1 if a statement that should hold fails or an "
        "erratum's printed form unexpectedly holds.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  gradmerge verify\n  gradmerge verify --seeds 50 --json verify.json",
    )
    p.add_argument(
        "--seeds", type=int, default=10, help="random cases per numeric check (%(default)s)"
    )
    p.add_argument(
        "--study",
        type=int,
        default=30,
        help="logistic problems in the merge-error study (%(default)s; 0: skip)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.set_defaults(run=run, check=check)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject out-of-range arguments through argparse (exit 2 with usage)."""
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    if args.study < 0:
        parser.error(f"--study must be 0 or more, got {args.study}")


def run(args: argparse.Namespace) -> int:
    """Print the table (and studies); 1 if a statement that should hold fails."""
    from gradmerge.theory import verify  # the theory testbed ships with the package
    from gradmerge.theory.numeric import study as studies

    start = time.perf_counter()
    print("gradmerge verify: the appendix of Daheim et al. (ICLR 2024), statement by statement")
    print(f"numeric checks on {args.seeds} random exact problems each (float64)\n", flush=True)
    rows = verify.collect(seeds=args.seeds)
    print(verify.format_table(rows))
    print("\n" + verify.summary(rows))
    report: dict = {"rows": verify.as_json(rows)}
    if args.study:
        report["studies"] = _studies(studies, args.study)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=float))
        print(f"\nwrote {args.json}")
    print(f"\ndone in {time.perf_counter() - start:.1f} s")
    return 1 if any(r.verdict == "FAILED" for r in rows) else 0


def _studies(studies: Any, problems: int) -> dict:
    """Measurements on random logistic problems (no pass/fail: the appendix claims no ranking)."""
    merge = studies.error_study(range(problems))
    removal = studies.removal_study(range(problems))
    orders = [studies.prior_scaling_orders(s) for s in range(min(problems, 8))]
    print(
        f"\nMerge on logistic regression, {merge['problems']} random problems: "
        "error ‖θ − θ_1:T‖ / ‖θ_1:T − θ_LLM‖"
    )
    for method, q in merge["quantiles"].items():
        print(
            f"  {method:16s} median {q['median']:.3f}  (10%: {q['q10']:.3f}, 90%: {q['q90']:.3f})"
            f"  closest on {merge['closest'][method]}"
        )
    print(
        f"  gradient matching beats task arithmetic on {merge['gm_full_beats_ta']} (full H_t) "
        f"and {merge['gm_diag_beats_ta']} (diagonal H_t) of {merge['problems']}"
    )
    print(
        f"\nRemoval on logistic regression, {removal['problems']} random problems: "
        "error ‖θ − θ_\\t‖ / ‖θ_\\t − θ_LLM‖ (1.0 = not removing at all)"
    )
    for method, q in removal["quantiles"].items():
        print(
            f"  {method:16s} median {q['median']:.3f}  (10%: {q['q10']:.3f}, 90%: {q['q90']:.3f})"
        )
    print(
        f"  Eq. 13 is closer than Koh & Liang on {removal['eq13_closer']} of {removal['problems']}"
    )
    import numpy as np

    med = {m: float(np.median([o[m] for o in orders])) for m in orders[0]}
    print(
        "\nOrder of the error in the task-vector size (H_0 → λH_0, fitted over λ = 30c..300c, "
        f"median of {len(orders)}): task arithmetic {med['task_arithmetic']:.2f} (theory: 1), "
        f"gradient matching {med['gm_full']:.2f} (theory: 2)"
    )
    merge.pop("rows")
    removal.pop("rows")
    return {"merge": merge, "removal": removal, "error_orders": orders}
