"""``gradmerge inspect CURVATURE...``: the scale of curvature files, and the δ where gradient
matching is its own method (:mod:`gradmerge.curvature.summary`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

EPILOG = """\
what it prints, per file: structure, num_examples and the other estimation records, the
diagonal entries' percentiles (min, p1, p10, p50, p90, p99, max) and fraction of exact zeros;
per layer (a tensor, or a K-FAC layer's weight and bias) the same, and for K-FAC the range
[λ_min, λ_max] of each factor A (inputs) and G (output gradients). Then, for the files
together (their sum, as a merge with alpha 1 forms Σ_t H_t), the δ window:

  gradient matching weights task t on coordinate i by  s·α_t + (1 − s)·α_t h_t/H,
  s = δ/(δ + H), H = Σ_t α_t h_t: task arithmetic's weight mixed with Fisher averaging's.
  Inside [ρ/(1−ρ)·H_p90, (1−ρ)/ρ·H_p10] (ρ = 1e-3) the share s is in [ρ, 1 − ρ] on the
  10th-90th percentile coordinates: below it the merge is Fisher averaging, above it task
  arithmetic, to three digits of that mixing. Coordinates with H = 0 get task arithmetic.

A subsample's curvature: files are SUMS over their examples (num_examples); a curvature from n
of a task's N examples stands for the task at `scale: N/n` (merge YAML, per model).

examples:
  gradmerge inspect a.curvature.safetensors b.curvature.safetensors
  gradmerge inspect a.curvature.safetensors --json scale.json --no-layers
  gradmerge inspect *.curvature.safetensors --json -      # JSON on stdout only
"""


def add_parser(sub: Any) -> None:
    """Register ``gradmerge inspect``."""
    p = sub.add_parser(
        "inspect",
        help="scale of curvature files (percentiles, zeros, K-FAC spectra) and the δ window",
        description="Summarise curvature files: per file and per layer the diagonal entries' "
        "percentiles and zeros, num_examples, structure, each K-FAC factor's spectrum range, "
        "and the δ range in which gradient matching differs from both Fisher averaging and task "
        "arithmetic.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    p.add_argument("curvatures", nargs="+", metavar="CURVATURE", help="curvature files")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON (- : stdout)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json PATH")
    p.add_argument("--no-layers", action="store_true", help="print no per-layer lines")
    p.add_argument(
        "--no-spectra",
        action="store_true",
        help="skip the K-FAC factors' eigenvalues (an eigendecomposition per factor)",
    )
    p.add_argument(
        "--rho", type=float, default=1e-3, help="share s counted as a difference (default 1e-3)"
    )
    p.set_defaults(run=run, check=check, writes=writes)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors (exit 2) for an unusable --rho, before any file is read."""
    from gradmerge.curvature.summary import check_rho
    from gradmerge.errors import ArgumentError

    try:
        check_rho(args.rho)
    except ArgumentError as err:
        parser.error(str(err))


def writes(args: argparse.Namespace) -> Any:
    """The output guard's declaration: ``--json`` PATH (not ``-``) and every CURVATURE."""
    from gradmerge._guard import Input
    from gradmerge.commands._writes import Writes, file_output

    inputs = [Input("CURVATURE", Path(p)) for p in args.curvatures]
    return Writes(file_output("--json", args.json), inputs)


def inspect_files(paths: list[Path], *, spectra: bool = True, rho: float = 1e-3) -> dict[str, Any]:
    """The numbers ``gradmerge inspect`` prints, as plain JSON values: ``files`` (one entry per
    path: structure, info, scale, layers) and ``delta_window`` for their sum.

    A file whose values a merge refuses — NaN/Inf (found decoding them), a clearly negative
    eigenvalue (:meth:`Curvature.check_psd`, which the merge rules call) — is reported with
    ``refused`` (the same message), and no δ window is given while one is. A file a merge cannot
    open (damaged, or a ``num_examples`` that is not a whole number ≥ 1:
    :func:`gradmerge.curvature.io.recorded_examples`) raises the same error as there.

    Raises:
        ArgumentError: ``rho`` outside (0, 0.5).
        FileFormatError: a file that is not a readable curvature file."""
    import torch

    from gradmerge.curvature.io import open_curvature
    from gradmerge.curvature.summary import (
        check_rho,
        delta_window,
        diagonal_values,
        factor_spectra,
        kfac_parts,
        scale_of,
        summed_diagonals,
    )
    from gradmerge.errors import ArgumentError, NonFiniteError
    from gradmerge.errors import NotPositiveDefiniteError as NotPD

    check_rho(rho)
    files: list[dict[str, Any]] = []
    diagonals: list[dict[str, Any]] = []
    refusals: list[str] = []
    for path in paths:
        with open_curvature(path) as f:
            layers, values, refused = [], {}, None
            for group in f.couplings():
                part = None
                try:  # a merge's checks of the values: finite (decoding them), PSD
                    part = f.restrict(group, dtype=torch.float64)
                    if part is not None:
                        part.check_psd(name=f"{path} ({group[0]})")
                except (NonFiniteError, NotPD) as err:
                    refused = refused or str(err)
                if part is None:
                    continue
                diag = diagonal_values(part)
                values.update(diag)
                layer: dict[str, Any] = {
                    "keys": list(group),
                    "structure": type(part).__name__,
                    "scale": scale_of(diag.values()).to_json(),
                }
                kfacs = kfac_parts(part)
                if spectra and kfacs:
                    layer["factors"] = {
                        name: terms for k in kfacs for name, terms in factor_spectra(k).items()
                    }
                layers.append(layer)
            files.append(
                {
                    "path": str(path),
                    "structure": f.structure,
                    "dtype": f.metadata.get("dtype"),
                    "info": dict(f.info),
                    "num_examples": f.num_examples,
                    "parameters": sum(s.numel() for _, s in f.layout),
                    "scale": scale_of(values.values()).to_json(),
                    "layers": layers,
                    "refused": refused,
                }
            )
            diagonals.append(values)
            if refused:
                refusals.append(refused)
    shared = set.intersection(*(set(d) for d in diagonals)) if diagonals else set()
    total = summed_diagonals({k: v for k, v in d.items() if k in shared} for d in diagonals)
    window: dict[str, Any] = {"rho": rho, "files": len(paths), "parameters": len(shared)}
    try:
        if refusals:
            raise ArgumentError(f"a merge refuses {len(refusals)} of the files (above)")
        low, high = delta_window(list(total.values()), rho=rho)
        window.update(low=low, high=high, empty=low > high)
    except ArgumentError as err:  # refused, or no positive entry
        window.update(low=None, high=None, empty=True, reason=str(err))
    return {"files": files, "delta_window": window}


def run(args: argparse.Namespace) -> int:
    """Run ``gradmerge inspect``; 0 on success, 1 on a file that cannot be read (the message
    goes to stderr) or that a merge refuses (reported, as ``merge --dry-run`` returns 1 where the
    real run would refuse)."""
    from gradmerge.errors import GradmergeError

    try:
        report = inspect_files(
            [Path(p) for p in args.curvatures], spectra=not args.no_spectra, rho=args.rho
        )
    except (GradmergeError, OSError) as err:
        print(f"gradmerge inspect: error: {err}", file=sys.stderr)
        return 1
    text = json.dumps(report, indent=2) + "\n"
    refused = any(f["refused"] for f in report["files"])
    if args.json == "-":
        sys.stdout.write(text)
        return 1 if refused else 0
    print(describe(report, layers=not args.no_layers))
    if args.json:
        from gradmerge._guard import write_text

        try:
            write_text(text, args.json, "--json")
        except GradmergeError as err:
            print(f"gradmerge inspect: error: {err}", file=sys.stderr)
            return 1
    return 1 if refused else 0


_COLUMNS = ("min", "p10", "p50", "p90", "max")


def _row(scale: dict[str, Any]) -> str:
    cells = " ".join(f"{scale[k]:>10.3g}" for k in _COLUMNS)
    return f"{cells} {100 * scale['zeros']:>6.1f}%" + (" (sampled)" if scale["sampled"] else "")


def describe(report: dict[str, Any], *, layers: bool = True) -> str:
    """The report as text (one block per file, then the δ window)."""
    head = " " * 2 + " ".join(f"{k:>10}" for k in _COLUMNS) + "  zeros"
    lines = []
    for f in report["files"]:
        n = f["num_examples"]
        lines.append(
            f"{f['path']}: {f['structure']}, {f['parameters']:,} parameters, "
            f"num_examples {n if n is not None else 'not recorded'}, dtype {f['dtype']}"
            + "".join(f", {k} {v}" for k, v in sorted(f["info"].items()) if k in ("fisher", "loss"))
        )
        if f["refused"]:
            lines.append(f"  REFUSED (a merge refuses it too): {f['refused']}")
        lines.append(head)
        lines.append(f"  {_row(f['scale'])}  all entries")
        if layers:
            for layer in f["layers"]:
                keys = layer["keys"]
                name = keys[0] if len(keys) == 1 else f"{keys[0]} (+{len(keys) - 1})"
                lines.append(f"  {_row(layer['scale'])}  {name} [{layer['structure']}]")
                for module, terms in layer.get("factors", {}).items():
                    for i, t in enumerate(terms):
                        tag = f"{module}" + (f" term {i}" if len(terms) > 1 else "")
                        lines.append(
                            f"      {tag}: A λ ∈ [{t['a_min']:.3g}, {t['a_max']:.3g}], "
                            f"G λ ∈ [{t['g_min']:.3g}, {t['g_max']:.3g}]"
                        )
    w = report["delta_window"]
    what = "the file" if w["files"] == 1 else f"the {w['files']} files summed (alpha 1)"
    if w["low"] is None:
        lines.append(f"δ window for {what}: none ({w.get('reason', 'no positive entry')})")
    elif w["empty"]:
        lines.append(
            f"δ window for {what}: empty — the entries span p90/p10 = "
            f"{_ratio(w['low'], w['high'], w['rho']):.3g} > {((1 - w['rho']) / w['rho']) ** 2:.3g}: "
            f"no single δ keeps gradient matching apart from both on 80% of the coordinates; "
            f"δ ≥ {w['low']:.3g} is not Fisher averaging on 90%, δ ≤ {w['high']:.3g} not task "
            "arithmetic on 90%"
        )
    else:
        lines.append(
            f"δ window for {what}: [{w['low']:.3g}, {w['high']:.3g}] — gradient matching differs "
            f"from Fisher averaging (below) and task arithmetic (above) there: prior share s in "
            f"[{w['rho']:g}, {1 - w['rho']:g}] on the 10th-90th percentile coordinates"
        )
    return "\n".join(lines)


def _ratio(low: float, high: float, rho: float) -> float:
    """H_p90/H_p10 from the window's ends."""
    p90, p10 = low * (1 - rho) / rho, high * rho / (1 - rho)
    return p90 / p10 if p10 > 0 else math.inf
