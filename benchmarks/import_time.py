"""Time of ``import gradmerge`` and of the command line's start-up in fresh processes, for one or
more source trees side by side.

Each repeat starts fresh interpreters in turn (so that the machine's load falls on every tree
alike): per tree one for ``import gradmerge`` and one for ``import gradmerge.cli`` (what the
``gradmerge`` command loads before parsing its arguments), and one for ``import torch`` alone, the
floor any gradmerge import pays. A
process measures its own import with ``time.perf_counter`` (wall) and ``time.process_time`` (CPU:
user + system) around the import statement (the interpreter's start-up is excluded) and reports
which optional packages the import loaded: a light ``import gradmerge`` loads none of sympy,
scikit-learn, matplotlib, transformers.

With ``--cli`` each repeat also runs, per tree, whole commands that answer without work
(``gradmerge --help``, ``--version``, ``merge --help``, ``curvature --help``: the CPU time of the
process, interpreter included, from ``resource.getrusage``) and, for the commands that do work,
what their run imports beyond torch (``import torch`` first, then the modules the run imports:
the CPU time of the second step and the optional packages it loaded; transformers and
safetensors should load only when a file needs them). CPU time, not wall time, is the figure
to compare on a busy machine.

The JSON is a ``benchmarks.record`` record (machine, versions, load before and after).

    python -m benchmarks.import_time --tree after=. --repeats 15
    python -m benchmarks.import_time --tree before=/tmp/gm-before --tree after=. --repeats 5 --cli \
        --out benchmarks/results/cli-start-cpu.json
    python -m benchmarks.import_time --tree before=/tmp/gm-before --tree after=. --repeats 15 \
        --out benchmarks/results/import-time-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.record import Run, write_result

OPTIONAL = (
    *("sympy", "sklearn", "matplotlib", "transformers", "tokenizers", "scipy"),
    *("torch", "safetensors", "numpy"),
)

PROBE = """
import json, sys, time
{before}
t, c = time.perf_counter(), time.process_time()
import {module}
seconds, cpu = time.perf_counter() - t, time.process_time() - c
print(json.dumps({{"seconds": seconds, "cpu_seconds": cpu,
                  "loaded": [m for m in {optional!r} if m in sys.modules]}}))
"""

COMMANDS = (("--help",), ("--version",), ("merge", "--help"), ("curvature", "--help"))
"""Commands that answer at once: ``--cli`` times each as a whole process."""

RUN_IMPORTS = {
    "merge": "gradmerge.jobs.engine",
    "curvature": "gradmerge.estimate, gradmerge.io.sources, gradmerge.commands.curvature",
    "evaluate": "gradmerge.evaluation, gradmerge.io.sources, gradmerge.commands.evaluate",
    "tune": "gradmerge.jobs.tune, gradmerge.evaluation, gradmerge.io.sources",
}
"""What each working command's run imports beyond torch (before it reads any file)."""


def _where(tree: Path | None) -> str:
    """The working folder of a probe: the tree itself (``python -c`` and ``-m`` put the working
    folder first on ``sys.path``, so that from a checkout its own package would shadow the tree
    named on ``PYTHONPATH``); the filesystem root for torch alone."""
    return str(tree) if tree is not None else os.sep


def _env(tree: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    return env


def _one(module: str, tree: Path | None, before: str = "") -> dict[str, Any]:
    code = PROBE.format(module=module, optional=OPTIONAL, before=before)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=_env(tree),
        cwd=_where(tree),
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _command(argv: tuple[str, ...], tree: Path | None) -> dict[str, Any]:
    """CPU seconds (user + system) and wall seconds of ``python -m gradmerge ARGV``, a whole
    process from the interpreter's start."""
    import time

    start, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "gradmerge", *argv],
        env=_env(tree),
        cwd=_where(tree),
        capture_output=True,
    )  # not checked: the tree before may refuse --version (exit 2); the time is what counts
    end = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (end.ru_utime - start.ru_utime) + (end.ru_stime - start.ru_stime)
    return {"seconds": time.perf_counter() - wall, "cpu_seconds": cpu, "loaded": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="a folder holding the gradmerge package to import (repeatable)",
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--cli",
        action="store_true",
        help="also time whole commands that answer at once, and the imports of working commands' "
        "runs beyond torch (CPU seconds)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = parser.parse_args()
    trees = {"torch": None} | {
        label: Path(path).resolve() for label, path in (t.split("=", 1) for t in args.tree)
    }
    run = Run("import_time", settings=vars(args))
    samples: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for label, tree in trees.items():
            for module in ("torch",) if tree is None else ("gradmerge", "gradmerge.cli"):
                key = label if tree is None else f"{label}: import {module}"
                samples.setdefault(key, []).append(_one(module, tree))
            if not args.cli or tree is None:
                continue
            for argv in COMMANDS:
                key = f"{label}: gradmerge {' '.join(argv)}"
                samples.setdefault(key, []).append(_command(argv, tree))
            for command, modules in RUN_IMPORTS.items():
                key = f"{label}: {command}'s run imports after torch"
                samples.setdefault(key, []).append(_one(modules, tree, before="import torch"))
    results: dict[str, Any] = {}
    for label, runs in samples.items():
        seconds = [r["seconds"] for r in runs]
        cpu = [r["cpu_seconds"] for r in runs]
        results[label] = {
            "tree": str(trees[label.split(":")[0]] or ""),
            "median_s": statistics.median(seconds),
            "min_s": min(seconds),
            "max_s": max(seconds),
            "median_cpu_s": statistics.median(cpu),
            "min_cpu_s": min(cpu),
            "max_cpu_s": max(cpu),
            "optional_loaded": sorted({m for r in runs for m in r["loaded"]}),
            "seconds": seconds,
            "cpu_seconds": cpu,
        }
        print(
            f"{label:>26}: CPU median {statistics.median(cpu):.3f} s "
            f"(min {min(cpu):.3f}, max {max(cpu):.3f}), wall median "
            f"{statistics.median(seconds):.3f} s, "
            f"modules loaded: {results[label]['optional_loaded'] or 'none'}"
        )
    record = run.finish(results)
    print(f"load average before {record['load']['before']}, after {record['load']['after']}")
    if args.out is not None:
        write_result(args.out, record)


if __name__ == "__main__":
    main()
