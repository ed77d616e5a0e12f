"""What each command that writes declares to the output guard (:mod:`gradmerge.foundation.guard`).

A command that writes gives its parser a declaration, ``p.set_defaults(writes=declare)``, where
``declare(args)`` returns :class:`Writes`: the outputs of this call (``OUT``, ``--json``,
``--out-dir``...) and everything it reads, resolved as loading will resolve it (MODEL and DATA
with :func:`gradmerge.io.sources.spec_inputs`: an entry point's file, a LoRA adapter's base;
``--tokenizer``; a configuration file and every path in it, :meth:`FromYaml.inputs
<gradmerge.jobs.options.FromYaml.inputs>`). :func:`guard` applies the guard's rules to it after the
command's own argument checks and before it runs, in ``gradmerge`` (:func:`gradmerge.cli.main`)
and under torchrun (:func:`gradmerge.commands.distributed.main`) alike: a refused output is an
argparse error (exit 2, one line after the usage). The library functions the commands call apply
the same rules again to what they know (``run_merge``, ``run_refine``, ``tune``,
``convert_curvature``, ``run_demo``), and write through the guard's staged writers.

``proofs_tests/reliability/test_output_guard.py`` runs every declared command through the
conformance grid (relation × ``--overwrite`` × fault): a new command that writes is covered by
declaring itself.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gradmerge.errors import GradmergeError, InputWarning
from gradmerge.foundation.guard import Input, Output, check


@dataclass
class Writes:
    """The outputs a command's call writes and the inputs it reads."""

    outputs: list[Output] = field(default_factory=list)
    inputs: list[Input] = field(default_factory=list)


Declare = Callable[[argparse.Namespace], Writes]
"""A command's declaration: its arguments ↦ :class:`Writes`."""


def guard(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Apply the output guard to the call's declaration (none: nothing to check).

    A declaration that cannot be made (a configuration file that does not read) is left to the
    command, which reports that error itself; ``--dry-run`` writes nothing and is not guarded.
    """
    declare: Declare | None = getattr(args, "writes", None)
    if declare is None or getattr(args, "dry_run", False):
        return
    try:
        with warnings.catch_warnings():  # the command reads its inputs again, and warns then
            warnings.simplefilter("ignore", InputWarning)
            writes = declare(args)
    except GradmergeError:
        return
    try:
        overwrite = bool(getattr(args, "overwrite", False))
        check(writes.outputs, writes.inputs, overwrite=overwrite, how="--overwrite")
    except GradmergeError as err:
        parser.error(str(err))


def reading_inputs(
    args: argparse.Namespace, models: Iterable[str], datas: Iterable[str]
) -> list[Input]:
    """The inputs of a command that reads MODELs and DATA with the reading flags
    (:func:`gradmerge.commands._inputs.add_reading_arguments`): each MODEL with its adapter's
    base, each DATA, ``--tokenizer`` and ``--adapter-base``."""
    from gradmerge.io.sources import spec_inputs

    found: list[Input] = []
    for model in models:
        found += spec_inputs("MODEL", model, base=getattr(args, "adapter_base", None))
    for data in datas:
        found += spec_inputs("DATA", data)
    for flag in ("tokenizer", "adapter_base"):
        value = getattr(args, flag, None)
        if value:
            found.append(Input(f"--{flag.replace('_', '-')}", Path(value)))
    return found


def file_output(role: str, value: str | None) -> list[Output]:
    """A file output given as ``value`` (none for ``None`` or ``-``, standard output)."""
    return [] if value is None or value == "-" else [Output(role, Path(value), "file")]
