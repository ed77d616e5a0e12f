"""``gradmerge inspect CURVATURE...`` / ``gradmerge inspect CONFIG.yaml``: the scale of curvature
files, and the δ where gradient matching is its own method (:mod:`gradmerge.curvature.summary`),
for the files summed or for exactly the merge a YAML describes
(:mod:`gradmerge.jobs.inspection`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from gradmerge.commands._flags import OVERWRITE

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

Every percentile is exact (numpy.percentile of the entries), computed in a few streamed passes
over the files with bounded memory.

A subsample's curvature: files are SUMS over their examples (num_examples); a curvature from n
of a task's N examples stands for the task at `scale: N/n` (merge YAML, per model).

with a merge CONFIG.yaml instead (one .yaml/.yml path): the merge's own H̄ = δI + s·C_0 +
Σ_t α_t·scale_t·H_t, as `gradmerge merge` builds it (its alphas, the global and per-model
`scale`, the prior's curvature, scale and δ), and for it:
  - the δ window, with a prior curvature c: [p90 of ρ/(1−ρ)·H − c, p10 of (1−ρ)/ρ·H − c];
  - the prior's share s = (δ + c)/(δ + c + H) at the configured δ: percentiles, and how many
    coordinates are Fisher averaging (s < ρ) or task arithmetic (s > 1 − ρ);
  - each merged unit's conditioning: [λ_min, λ_max] and κ of its system (exact for diagonal,
    dense, one-term and small K-FAC layers; "(bounds)": Weyl bounds, κ an upper bound), its
    K-FAC factors' spectra, and the worst-conditioned units.

examples:
  gradmerge inspect a.curvature.safetensors b.curvature.safetensors
  gradmerge inspect merge.yaml                            # exactly that merge's H̄
  gradmerge inspect merge.yaml --json hbar.json --no-layers
  gradmerge inspect a.curvature.safetensors --json scale.json --no-layers
  gradmerge inspect *.curvature.safetensors --json -      # JSON on stdout only
"""


def add_parser(sub: Any) -> None:
    """Register ``gradmerge inspect``."""
    p = sub.add_parser(
        "inspect",
        help="scale of curvature files, or of a merge CONFIG's H̄: percentiles, K-FAC spectra, "
        "conditioning, the δ window",
        description="Summarise curvature files: per file and per layer the diagonal entries' "
        "percentiles and zeros, num_examples, structure, each K-FAC factor's spectrum range, "
        "and the δ range in which gradient matching differs from both Fisher averaging and task "
        "arithmetic. Given a merge CONFIG.yaml instead: the same δ window, the prior's share and "
        "each unit's conditioning for exactly the system that merge solves.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    p.add_argument(
        "curvatures",
        nargs="+",
        metavar="CURVATURE|CONFIG",
        help="curvature files, or one merge CONFIG.yaml",
    )
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON (- : stdout)")
    OVERWRITE.add(p, what="an existing --json PATH")
    p.add_argument(
        "--no-layers", action="store_true", help="print no per-layer (CONFIG: per-unit) lines"
    )
    p.add_argument(
        "--no-spectra",
        action="store_true",
        help="skip the K-FAC factors' eigenvalues (an eigendecomposition per factor)",
    )
    p.add_argument(
        "--rho",
        type=float,
        default=1e-3,
        help="share s counted as a difference (default %(default)s)",
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
    """The output guard's declaration: ``--json`` PATH (not ``-``) against every CURVATURE, or
    against one CONFIG with every path it names (:meth:`FromYaml.inputs
    <gradmerge.jobs.options.FromYaml.inputs>`)."""
    from gradmerge.commands._writes import Writes, file_output
    from gradmerge.foundation.guard import Input

    paths = [Path(p) for p in args.curvatures]
    if len(paths) == 1 and _is_config(paths[0]):
        from gradmerge.jobs.config import MergeConfig

        inputs = MergeConfig.from_yaml(paths[0]).inputs()
    else:
        inputs = [Input("CURVATURE", p) for p in paths]
    return Writes(file_output("--json", args.json), inputs)


def _is_config(path: Path) -> bool:
    """Whether ``inspect`` reads ``path`` as a merge CONFIG (a ``.yaml``/``.yml`` file)."""
    return path.suffix.lower() in (".yaml", ".yml")


def inspect_files(paths: list[Path], *, spectra: bool = True, rho: float = 1e-3) -> dict[str, Any]:
    """The numbers ``gradmerge inspect`` prints, as plain JSON values: ``files`` (one entry per
    path: structure, info, scale, layers) and ``delta_window`` for their sum.

    Streamed: the files are read unit by unit (the smallest groups of parameters their
    structures couple, joined across the files), in as many passes as the exact percentiles
    need (:mod:`gradmerge.curvature.quantiles`: two for real curvatures), holding one unit of
    every file at a time. Layers, spectra and the per-layer percentiles come from the first
    pass. A diagonal file's entries are summarised as stored; computed entries (K-FAC, dense,
    lazy sums) and the files' sum in float64.

    A file whose values a merge refuses — NaN/Inf (found decoding them), a clearly negative
    eigenvalue (:meth:`Curvature.check_psd`, which the merge rules call) — is reported with
    ``refused`` (the same message), and no δ window is given while one is. A file a merge cannot
    open (damaged, or a ``num_examples`` that is not a whole number ≥ 1:
    :func:`gradmerge.curvature.io.recorded_examples`) raises the same error as there.

    Raises:
        ArgumentError: ``rho`` outside (0, 0.5).
        FileFormatError: a file that is not a readable curvature file."""
    from contextlib import ExitStack

    import torch

    from gradmerge.curvature.io import open_curvature
    from gradmerge.curvature.quantiles import CHUNK, OrderStatistics, finish
    from gradmerge.curvature.summary import (
        PERCENTILES,
        WINDOW,
        check_rho,
        diagonal_values,
        factor_spectra,
        kfac_parts,
        scale_from,
        window_from,
        window_json,
    )
    from gradmerge.errors import ArgumentError, NonFiniteError
    from gradmerge.errors import NotPositiveDefiniteError as NotPD

    check_rho(rho)
    with ExitStack() as stack:
        opened = [stack.enter_context(open_curvature(path)) for path in paths]
        dtypes = [_summary_dtype(f.structure, f.metadata.get("dtype")) for f in opened]
        single = len(opened) == 1  # the sum is the file itself: its own statistics hold it
        window = WINDOW if single else None
        stats = [OrderStatistics(PERCENTILES, positive=window, dtype=d) for d in dtypes]
        total = stats[0] if single else OrderStatistics({}, positive=WINDOW)
        selectors = stats if single else [*stats, total]
        shared = set.intersection(*({k for k, _ in f.layout} for f in opened))
        layers: list[list[tuple[int, dict[str, Any]]]] = [[] for _ in opened]
        refused: list[str | None] = [None for _ in opened]
        first = True
        while first or any(s.wants_pass for s in selectors):
            for unit in _joint_units([f.couplings() for f in opened]):
                diagonals: dict[int, dict[str, torch.Tensor]] = {}
                for i, index, group in unit:
                    if not (first or stats[i].wants_pass or total.wants_pass):
                        continue
                    stored = dtypes[i] == torch.float32
                    part = None
                    try:  # a merge's checks of the values: finite (decoding them), PSD
                        part = opened[i].restrict(group, dtype=None if stored else torch.float64)
                        if first and part is not None:
                            part.check_psd(name=f"{paths[i]} ({group[0]})")
                    except (NonFiniteError, NotPD) as err:
                        refused[i] = refused[i] or str(err)
                    if part is None:
                        continue
                    diag = diagonal_values(part)
                    diagonals.setdefault(i, {}).update(diag)
                    if not first:
                        if stats[i].wants_pass:
                            for values in diag.values():
                                stats[i].add(values)
                        continue
                    own = OrderStatistics(PERCENTILES, dtype=dtypes[i])
                    for values in diag.values():
                        own.add(values)
                    stats[i].absorb(own)  # the file's first pass: its layers' first passes
                    layer: dict[str, Any] = {
                        "keys": list(group),
                        "structure": type(part).__name__,
                        "scale": scale_from(finish(own, diag.values())).to_json(),
                    }
                    kfacs = kfac_parts(part)
                    if spectra and kfacs:
                        layer["factors"] = {
                            name: terms for k in kfacs for name, terms in factor_spectra(k).items()
                        }
                    layers[i].append((index, layer))
                if total.wants_pass and not single:
                    keys = [k for _, _, group in unit for k in group if k in shared]
                    for key in dict.fromkeys(keys):
                        parts = [d[key].reshape(-1) for d in diagonals.values() if key in d]
                        if not parts:  # refused (NaN/Inf) in every file: no window then
                            continue
                        for start in range(0, parts[0].numel(), CHUNK):  # no float64 copy
                            summed = parts[0][start : start + CHUNK].double()  # of a whole tensor
                            for other in parts[1:]:
                                summed += other[start : start + CHUNK]
                            total.add(summed)
            for s in selectors:
                if s.wants_pass:
                    s.end_pass()
            first = False
        files = [
            {
                "path": str(path),
                "structure": f.structure,
                "dtype": f.metadata.get("dtype"),
                "info": dict(f.info),
                "num_examples": f.num_examples,
                "parameters": sum(s.numel() for _, s in f.layout),
                "scale": scale_from(stat).to_json(),
                "layers": [layer for _, layer in sorted(found, key=lambda x: x[0])],
                "refused": why,
            }
            for path, f, stat, found, why in zip(paths, opened, stats, layers, refused, strict=True)
        ]
    found: dict[str, Any] = {"rho": rho, "files": len(paths), "parameters": len(shared)}
    refusals = [why for why in refused if why]
    try:
        if refusals:
            raise ArgumentError(f"a merge refuses {len(refusals)} of the files (above)")
        found.update(window_json(*window_from(total, rho=rho)))
    except ArgumentError as err:  # refused, or no positive entry
        found.update(window_json(None, None), reason=str(err))
    return {"files": files, "delta_window": found}


def _summary_dtype(structure: str, dtype: str | None) -> Any:
    """float32 for a diagonal file stored in float32/16 (its entries exact in float32), else
    float64."""
    import torch

    narrow = structure == "diag" and dtype in ("float32", "float16", "bfloat16")
    return torch.float32 if narrow else torch.float64


def _joint_units(
    couplings: list[list[tuple[str, ...]]],
) -> list[list[tuple[int, int, tuple[str, ...]]]]:
    """The files' coupling groups joined where they share a parameter (a K-FAC layer in one
    file, its weight and bias as two diagonal tensors in another: one unit), in order of first
    appearance; each unit lists (file, the group's index in that file, the group)."""
    parent: dict[str, str] = {}

    def root(k: str) -> str:
        while parent.setdefault(k, k) != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for groups in couplings:
        for group in groups:
            for k in group[1:]:
                parent[root(k)] = root(group[0])
    units: dict[str, list[tuple[int, int, tuple[str, ...]]]] = {}
    for i, groups in enumerate(couplings):
        for index, group in enumerate(groups):
            units.setdefault(root(group[0]), []).append((i, index, group))
    return sorted(units.values(), key=lambda u: min((i, index) for i, index, _ in u))


def run(args: argparse.Namespace) -> int:
    """Run ``gradmerge inspect``; 0 on success, 1 on a file that cannot be read (the message
    goes to stderr) or that a merge refuses (reported, as ``merge --dry-run`` returns 1 where the
    real run would refuse)."""
    from gradmerge.errors import GradmergeError

    try:
        report = inspect_paths(
            [Path(p) for p in args.curvatures], spectra=not args.no_spectra, rho=args.rho
        )
    except (GradmergeError, OSError) as err:
        print(f"gradmerge inspect: error: {err}", file=sys.stderr)
        return 1
    text = json.dumps(report, indent=2) + "\n"
    refused = any(f.get("refused") for f in report.get("files", []))
    if args.json == "-":
        sys.stdout.write(text)
        return 1 if refused else 0
    print(describe(report, layers=not args.no_layers))
    if args.json:
        from gradmerge.foundation.guard import write_text

        try:
            write_text(text, args.json, "--json")
        except GradmergeError as err:
            print(f"gradmerge inspect: error: {err}", file=sys.stderr)
            return 1
    return 1 if refused else 0


_COLUMNS = ("min", "p10", "p50", "p90", "max")


def _row(scale: dict[str, Any]) -> str:
    cells = " ".join(f"{scale[k]:>10.3g}" for k in _COLUMNS)
    return f"{cells} {100 * scale['zeros']:>6.1f}%"


def describe(report: dict[str, Any], *, layers: bool = True) -> str:
    """The report as text (one block per file, then the δ window; for a CONFIG report,
    :func:`describe_config`)."""
    if "units" in report:
        return describe_config(report, layers=layers)
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
                lines.append(
                    f"  {_row(layer['scale'])}  {_name(layer['keys'])} [{layer['structure']}]"
                )
                lines += _factor_lines(layer)
    w = report["delta_window"]
    what = "the file" if w["files"] == 1 else f"the {w['files']} files summed (alpha 1)"
    span = ""
    lower, upper = w["not_fisher_from"], w["not_arithmetic_up_to"]
    if lower is not None and w["empty"]:
        ratio = _ratio(lower, upper, w["rho"])
        span = (
            f" — the entries span p90/p10 = {ratio:.3g} > {((1 - w['rho']) / w['rho']) ** 2:.3g}:"
        )
    lines.append(
        _window_line(what, lower, upper, w["rho"], w.get("reason", "no positive entry"), span)
    )
    return "\n".join(lines)


def _window_line(
    what: str, low: float | None, high: float | None, rho: float, reason: str, span: str = ""
) -> str:
    """The δ window between the bounds ``low`` (not Fisher averaging from) and ``high`` (not
    task arithmetic up to) as a sentence: none (``reason``), empty (``low`` > ``high``: ``span``
    says why), or the interval [low, high] in which gradient matching is its own method."""
    if low is None or high is None:
        return f"δ window for {what}: none ({reason})"
    if low > high:
        return (
            f"δ window for {what}: empty{span or ' —'} no single δ keeps gradient matching apart "
            f"from both on 80% of the coordinates; δ ≥ {low:.3g} is not Fisher averaging on 90%, "
            f"δ ≤ {high:.3g} not task arithmetic on 90%"
        )
    return (
        f"δ window for {what}: [{low:.3g}, {high:.3g}] — gradient matching differs from Fisher "
        f"averaging (below) and task arithmetic (above) there: prior share s in [{rho:g}, "
        f"{1 - rho:g}] on at least 80% of the coordinates"
    )


def _name(keys: list[str]) -> str:
    """A layer's or unit's first parameter, and how many more it has."""
    return keys[0] if len(keys) == 1 else f"{keys[0]} (+{len(keys) - 1})"


def _factor_lines(layer: dict[str, Any]) -> list[str]:
    """The factor spectra of a layer or unit, one line per Kronecker term."""
    lines = []
    for module, terms in layer.get("factors", {}).items():
        for i, t in enumerate(terms):
            tag = f"{module}" + (f" term {i}" if len(terms) > 1 else "")
            lines.append(
                f"      {tag}: A λ ∈ [{t['a_min']:.3g}, {t['a_max']:.3g}], "
                f"G λ ∈ [{t['g_min']:.3g}, {t['g_max']:.3g}]"
            )
    return lines


WORST = 5
"""Units named in a CONFIG report's conditioning summary (the largest κ)."""


def describe_config(report: dict[str, Any], *, layers: bool = True) -> str:
    """A CONFIG report (:func:`gradmerge.jobs.inspection.inspect_config`) as text: the merge,
    the δ window and the prior's share for it, each unit's conditioning (``layers``) and the
    worst-conditioned units."""
    lines = [f"{report['config']}: {report['method']}, {len(report['models'])} models"]
    for t, m in enumerate(report["models"]):
        n = m["num_examples"]
        lines.append(
            f"  models[{t}] {m['model']}: alpha {m['alpha']:g}, scale {m['scale']:g}"
            + (
                f", curvature {m['curvature']} (num_examples {n if n is not None else '?'})"
                if m["curvature"]
                else ""
            )
        )
    prior = report["prior"]
    if prior is not None:
        curv = " + ".join(prior["curvature"])
        lines.append(
            f"  prior: δ = {prior['delta']:g}"
            + (f" + {prior['scale']:g}·({curv})" if prior["curvature"] else "")
        )
    share = report.get("prior_share")
    if share is not None:
        rho, n = share["rho"], share["coordinates"]
        what = "this merge (its alphas, scales and prior curvature)"
        reason = "no coordinate with Σ α_t H_t > 0"
        lines.append(
            _window_line(what, share["not_fisher_from"], share["not_arithmetic_up_to"], rho, reason)
        )
        if n:
            p = share["share"]
            lines.append(
                f"prior share s = (δ + c)/(δ + c + Σ α_t H_t) at δ = {share['delta']:g}, over "
                f"{n:,} coordinates: min {p['min']:.3g}, p10 {p['p10']:.3g}, p50 "
                f"{p['p50']:.3g}, p90 {p['p90']:.3g}, max {p['max']:.3g}; s < {rho:g} (Fisher "
                f"averaging) on {100 * share['fisher_like'] / n:.1f}%, s > {1 - rho:g} (task "
                f"arithmetic) on {100 * share['arithmetic_like'] / n:.1f}%"
            )
        if share["no_curvature"] or share["negative"]:
            lines.append(
                f"  {share['no_curvature']:,} coordinates without curvature (task arithmetic "
                f"there), {share['negative']:,} with Σ α_t H_t < 0 (a negative alpha)"
            )
    units = report["units"]
    lines.append(f"conditioning of the system each of the {len(units)} merged units solves:")
    if layers:
        lines += [f"  {_unit_line(u)}" + "".join(f"\n{x}" for x in _factor_lines(u)) for u in units]
    ranked = sorted(units, key=_condition_rank, reverse=True)[:WORST]
    lines.append(f"the {len(ranked)} worst conditioned:")
    lines += [f"  {_unit_line(u)}" for u in ranked]
    return "\n".join(lines)


def _condition_rank(unit: dict[str, Any]) -> float:
    """κ, +∞ for a singular (or unbounded) system, −1 for a unit without one."""
    if unit["structure"] is None:
        return -1.0
    return math.inf if unit["condition"] is None else float(unit["condition"])


def _unit_line(unit: dict[str, Any]) -> str:
    name = _name(unit["keys"])
    if unit["structure"] is None:
        return f"{name}: no system (no curvature covers it)"
    bound = "" if unit["exact"] else " (bounds)"
    kappa = "singular" if unit["condition"] is None else f"κ = {unit['condition']:.3g}"
    return (
        f"{kappa:>14}  λ ∈ [{unit['min_eigenvalue']:.3g}, {unit['max_eigenvalue']:.3g}]{bound}  "
        f"{name} [{unit['structure']}]"
    )


def inspect_paths(paths: list[Path], *, spectra: bool = True, rho: float = 1e-3) -> dict[str, Any]:
    """``gradmerge inspect``'s report: of one merge CONFIG (a ``.yaml``/``.yml`` path:
    :func:`gradmerge.jobs.inspection.inspect_config`) or of curvature files
    (:func:`inspect_files`).

    Raises:
        ArgumentError: a CONFIG given with other paths.
        ConfigError: a CONFIG that ``gradmerge merge`` would refuse.
    """
    configs = [p for p in paths if _is_config(p)]
    if not configs:
        return inspect_files(paths, spectra=spectra, rho=rho)
    if len(paths) != 1:
        from gradmerge.errors import ArgumentError

        raise ArgumentError(
            f"inspect takes one merge CONFIG or curvature files, got {len(configs)} YAML file(s) "
            f"among {len(paths)} paths: inspect a merge's YAML alone (it names its curvatures)"
        )
    from gradmerge.jobs.config import MergeConfig
    from gradmerge.jobs.inspection import inspect_config

    return inspect_config(MergeConfig.from_yaml(configs[0]), rho=rho, spectra=spectra)


def _ratio(low: float, high: float, rho: float) -> float:
    """H_p90/H_p10 from the window's ends."""
    p90, p10 = low * (1 - rho) / rho, high * rho / (1 - rho)
    return p90 / p10 if p10 > 0 else math.inf
