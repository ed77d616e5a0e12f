"""``gradmerge merge CONFIG.yaml OUT_DIR``: merge checkpoints, streaming tensor group by group."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from gradmerge.commands._flags import NO_PROGRESS, OVERWRITE
from gradmerge.foundation.text import byte_size

EPILOG = """\
configuration (YAML; relative paths are relative to the YAML file), for example:

  method: gradient_matching       # {method_names}
  base_model: path/to/base        # θ_LLM: .safetensors file, shard folder or Hugging Face folder
  models:
    - {model: path/to/finetuned_a, curvature: a.curvature.safetensors, alpha: 1.0}
    - {model: path/to/finetuned_b, curvature: b.curvature.safetensors}
  prior: {delta: 1.0e-6}          # H_0 = δI (+ s·C from curvature files)

{keys}

methods:
{methods}

Tensors are read, merged and written one group at a time (a tensor, or a K-FAC layer's weight
and bias; a dense curvature couples every parameter, so it makes the whole model one group).
Integer tensors and buffers are copied from the base. OUT_DIR appears only when the merge
succeeded; it also holds the base's config/tokenizer files and gradmerge_merge.json, a record
of the method, the weights and each input's fingerprint.

examples:
  gradmerge merge merge.yaml merged/
  gradmerge merge merge.yaml merged/ --overwrite
  gradmerge merge merge.yaml merged/ --dry-run      # check the inputs, print the plan
"""


def epilog() -> str:
    """The help's text, its method names, keys and method table from the registry and the
    settings' declarations (:mod:`gradmerge.jobs.config`), as :mod:`gradmerge.commands._job_help`
    holds them (no torch)."""
    import textwrap

    from gradmerge.commands._job_help import TEXTS

    keys = textwrap.fill(
        f"Every key ({TEXTS['merge_keys']}) is described once, with examples, in docs/config.md "
        "of the gradmerge repository.",
        width=98,
    )
    return (
        EPILOG.replace("{method_names}", TEXTS["merge_method_names"])
        .replace("{keys}", keys)
        .replace("{methods}", TEXTS["merge_methods"])
    )


def add_parser(sub: Any) -> None:
    """Register ``gradmerge merge``."""
    p = sub.add_parser(
        "merge",
        help="merge fine-tuned checkpoints (Eq. 6 and its special cases), streaming",
        description="Merge fine-tuned checkpoints into OUT_DIR by task arithmetic, Fisher "
        "averaging, uncertainty-based gradient matching (Eq. 6), RegMean, TSV-M, Iso-C or "
        "Iso-CTS, reading and writing safetensors tensor group by tensor group (bounded memory).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=epilog(),
    )
    add_common_arguments(p)
    p.set_defaults(run=run, writes=writes)


def writes(args: argparse.Namespace) -> Any:
    """The output guard's declaration (:mod:`gradmerge.commands._writes`): OUT_DIR, and CONFIG
    with every path it names."""
    from gradmerge.jobs import MergeConfig

    return config_writes(args, MergeConfig.from_yaml(args.config))


def config_writes(args: argparse.Namespace, config: Any) -> Any:
    """OUT_DIR against ``config``'s inputs (:meth:`~gradmerge.jobs.options.FromYaml.inputs`)."""
    from pathlib import Path

    from gradmerge.commands._writes import Writes
    from gradmerge.foundation.guard import Output

    return Writes([Output("OUT_DIR", Path(args.out_dir), "folder")], config.inputs())


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """CONFIG, OUT_DIR and the flags ``merge`` and ``remove`` share."""
    p.add_argument("config", metavar="CONFIG.yaml", help="the configuration (see below)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output folder (must not exist)")
    OVERWRITE.add(p, what="OUT_DIR if it exists")
    p.add_argument(
        "--dry-run", action="store_true", help="check the inputs and print the plan; write nothing"
    )
    NO_PROGRESS.add(p)


def run(args: argparse.Namespace) -> int:
    """Run ``gradmerge merge``; 0 on success, 1 on bad input (the message goes to stderr)."""
    from gradmerge.jobs import MergeConfig, plan_merge, run_merge

    return run_command(args, "merge", MergeConfig.from_yaml, plan_merge, run_merge)


def run_command(
    args: argparse.Namespace,
    command: str,
    load: Callable[[str], Any],
    plan: Callable[[Any], Any],
    execute: Callable[..., Any],
) -> int:
    """Load the configuration, then plan (``--dry-run``) or run; errors as one line on stderr,
    warnings as :func:`_warnings_once` prints them."""
    from gradmerge.errors import GradmergeError

    with _warnings_once(command):
        try:
            config = load(args.config)
            if args.dry_run:
                print(describe_plan(plan(config), config))
                return describe_systems(config)
            report = execute(
                config, args.out_dir, overwrite=args.overwrite, progress=not args.no_progress
            )
        except (GradmergeError, OSError) as err:
            print(f"gradmerge {command}: error: {err}", file=sys.stderr)
            return 1
        print(
            f"{config.method}: wrote {report.tensors} tensors ({report.merged} merged, "
            f"{report.copied} copied from the base) in {len(report.files)} files to {report.out_dir}\n"
            f"read {byte_size(report.bytes_read)}, wrote {byte_size(report.bytes_written)} in "
            f"{report.seconds:.2f} s on {report.device}"
        )
        for note in report.notes:
            print(note)
        if report.solves:
            worst = max(report.solves, key=lambda k: report.solves[k]["residual"])
            iterations = sum(v["iterations"] for v in report.solves.values())
            print(
                f"solved {len(report.solves)} systems ({iterations} CG iterations); largest relative "
                f"residual {report.max_residual:.1e} ({worst}; every one in gradmerge_{command}.json)"
            )
            short = [k for k, v in report.solves.items() if not v.get("success", True)]
            if short:
                print(
                    f"approximate solves (solver.approximate): {len(short)} of {len(report.solves)} "
                    "systems stopped above solver.tol; their residuals are in the record"
                )
        for path in report.stale_removed:
            print(f"removed {path.name}, a staging folder left by a run that was killed")
        for path in report.stale_left:
            print(
                f"left {path.name} in place: a staging folder of an unknown process; remove it if no "
                "gradmerge run writes there"
            )
        return 0


@contextlib.contextmanager
def _warnings_once(command: str) -> Iterator[None]:
    """Each :class:`InputWarning` raised in the block is printed once, as ``gradmerge COMMAND:
    warning: ...`` (the dry run opens the inputs more than once; Python would attribute them to
    this module), unless the caller's warning filters ignore it (``warnings.simplefilter(
    "ignore", gm.InputWarning)``)."""
    from gradmerge.errors import InputWarning

    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", InputWarning)
            yield
    finally:
        _replay(caught, command)  # the caller's filters are back in force here


def _replay(caught: list[Any], command: str) -> None:
    """Show warnings recorded during a command: each distinct InputWarning once, on one line,
    where the filters in force let it through; every other warning (which passed the filters
    when it was recorded) as Python shows it."""
    from gradmerge.errors import InputWarning

    seen: set[str] = set()
    for w in caught:
        if not issubclass(w.category, InputWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
            continue
        if str(w.message) in seen:
            continue
        seen.add(str(w.message))
        with warnings.catch_warnings(record=True) as shown:  # the filters as they stand
            try:
                warnings.warn_explicit(w.message, w.category, "gradmerge", 0, registry={})
            except InputWarning:  # a filter asked for an error: still say it, once
                shown.append(w)
        if shown:
            print(f"gradmerge {command}: warning: {w.message}", file=sys.stderr)


def describe_systems(config: Any) -> int:
    """``--dry-run``: check every unit's linear system (:mod:`gradmerge.jobs.conditioning`)
    and, for gradient matching, δ against the curvatures; print what needs damping. 1 if a solve
    would fail, else 0."""
    from gradmerge.jobs import MergeConfig, RemoveConfig
    from gradmerge.jobs.conditioning import check_systems, delta_note

    checks = check_systems(config)
    bad = [c for c in checks if not c.ok]
    if checks:
        print(f"systems: {len(checks) - len(bad)} of {len(checks)} units solvable as configured")
        print(f"  {_checked(checks)}")
    for check in bad:
        print(f"  {check.describe()}")
    fixable = [c.needed for c in bad if math.isfinite(c.needed)]
    if fixable:
        print(
            f"set `{bad[0].key}` to at least {max(fixable):.2g} (the largest above) and run again"
        )
    if not bad and isinstance(config, RemoveConfig):
        return _removal_verdict(config)
    note = delta_note(config) if isinstance(config, MergeConfig) else None
    if note:
        print(f"gradmerge merge: warning: {note}", file=sys.stderr)
    return 1 if bad else 0


def _checked(checks: Any) -> str:
    """What the dry run checked of the units' values, by how it judged them."""
    computed = sum(c.solved is not None for c in checks)
    parts = []
    if computed:
        parts.append(
            f"{computed} computed as the real run computes them (solve, certificate, overflow "
            "of the compute and output dtypes)"
        )
    if len(checks) > computed:
        parts.append(
            f"{len(checks) - computed} judged by their smallest eigenvalue without computing "
            "(their results' overflow is checked by the real run only)"
        )
    return "; ".join(parts)


def _removal_verdict(config: Any) -> int:
    """``--dry-run`` of a diagonal ``remove``: the step and rounding checks the real run makes
    before writing, on the same computed result; 1 where the real run would refuse."""
    from gradmerge.errors import StepTooLargeError
    from gradmerge.jobs.conditioning import removal_checks

    found = removal_checks(config)
    if found is None:
        return 0
    step, rounding = found
    print(step.describe())
    print(rounding.describe())
    try:
        step.check(config.step_check, config.max_relative_step)
        rounding.check(config.rounding_check, config.max_rounding)
    except StepTooLargeError as err:
        print(f"the real run would refuse it: {err}")
        return 1
    return 0


def describe_plan(plan: Any, config: Any) -> str:
    """A short description of a plan, for ``--dry-run``."""
    largest = list(plan.largest_unit.keys)
    return (
        f"{config.method}: inputs fit together (names, shapes, dtypes; their values — NaN/Inf — "
        "are checked only by the real run, as is any result not computed below).\n"
        f"{len(plan.shapes)} tensors: {len(plan.merged)} merged in {sum(u.merged for u in plan.units)} "
        f"groups, {len(plan.copied)} copied from the base; output {byte_size(plan.out_bytes())}\n"
        f"largest group: {largest[:4]}{' ...' if len(largest) > 4 else ''} ({len(largest)} tensors)"
    )
