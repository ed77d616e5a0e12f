"""Time of ``import gradmerge`` in fresh processes, for one or more source trees side by side.

Each repeat starts fresh interpreters in turn (so that the machine's load falls on every tree
alike): per tree one for ``import gradmerge`` and one for ``import gradmerge.cli`` (what the
``gradmerge`` command loads before parsing its arguments), and one for ``import torch`` alone, the
floor any gradmerge import pays. A
process measures its own import with ``time.perf_counter`` around the import statement (the
interpreter's start-up is excluded) and reports which optional packages the import loaded: a
light ``import gradmerge`` loads none of sympy, scikit-learn, matplotlib, transformers.

The JSON is a ``benchmarks.record`` record (machine, versions, load before and after).

    python -m benchmarks.import_time --tree after=. --repeats 15
    python -m benchmarks.import_time --tree before=/tmp/gm-before --tree after=. --repeats 15 \
        --out benchmarks/results/import-time-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.record import Run, write_result

OPTIONAL = ("sympy", "sklearn", "matplotlib", "transformers", "tokenizers", "scipy")

PROBE = """
import json, sys, time
t = time.perf_counter()
import {module}
seconds = time.perf_counter() - t
print(json.dumps({{"seconds": seconds,
                  "loaded": [m for m in {optional!r} if m in sys.modules]}}))
"""


def _one(module: str, tree: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    code = PROBE.format(module=module, optional=OPTIONAL)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


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
    results: dict[str, Any] = {}
    for label, runs in samples.items():
        seconds = [r["seconds"] for r in runs]
        results[label] = {
            "tree": str(trees[label.split(":")[0]] or ""),
            "median_s": statistics.median(seconds),
            "min_s": min(seconds),
            "max_s": max(seconds),
            "optional_loaded": sorted({m for r in runs for m in r["loaded"]}),
            "seconds": seconds,
        }
        print(
            f"{label:>26}: median {statistics.median(seconds):.3f} s "
            f"(min {min(seconds):.3f}, max {max(seconds):.3f}), "
            f"optional modules loaded: {results[label]['optional_loaded'] or 'none'}"
        )
    record = run.finish(results)
    print(f"load average before {record['load']['before']}, after {record['load']['after']}")
    if args.out is not None:
        write_result(args.out, record)


if __name__ == "__main__":
    main()
