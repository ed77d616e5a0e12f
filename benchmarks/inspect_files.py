"""`gradmerge inspect` against a process that only loads the same files and computes the same
order statistics.

Files: diagonal curvature files written with gradmerge's own ``C.save`` from random positive
float32 values (log-uniform over ten decades, as real Fisher entries spread), with the layouts of
real models built from their configurations on the meta device (no weights, no download):

- ``minilm``: two files of MiniLM-L6 (BERT, 6 layers, width 384, 22.7M parameters: 91 MB each);
- ``gpt2``: one file of GPT-2-124M (124.4M parameters: 498 MB).

Each side runs as a fresh process (start-up included), measured by wall time and peak resident
memory (VmHWM, sampled every 5 ms), best of ``--repeats`` runs each, the two sides alternated so
that the machine's other load weighs on both alike; ``os.getloadavg()`` is recorded before every
run. The sides:

- ``baseline``: ``safetensors.numpy.load_file`` of every file, then ``numpy.percentile`` (float64)
  of each file's concatenated entries (min, p1, p10, p50, p90, p99, max), of each tensor, and of
  the positive entries of the files' sum (p10, p90: the δ window), with every value in memory;
  each phase is timed inside the process (``phases_seconds``: load, files, tensors, window), so
  that the ratio to its first two alone (loading and the files' own percentiles) can be read too;
- ``inspect``: ``gradmerge inspect FILES --json OUT`` (its text on stdout, its numbers in OUT).

The report also checks that the two agree EXACTLY (every percentile of every file and tensor, and
both ends of the δ window): inspect's percentiles are exact order statistics, not estimates.

    python -m benchmarks.inspect_files                 # writes benchmarks/results/inspect-cpu.json
    python -m benchmarks.inspect_files --quick         # a smoke run on small layouts
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.record import RESULTS, Run, load, module_argv, output, run_measured, write_result

PERCENTILES = {"min": 0, "p1": 1, "p10": 10, "p50": 50, "p90": 90, "p99": 99, "max": 100}
RHO = 1e-3  # inspect's default share ρ, for the window's ends


def layout(name: str) -> dict[str, Any]:
    """Parameter shapes of a real model, from its configuration (meta device: no memory)."""
    import torch
    import transformers

    sizes = {  # (vocabulary, width, layers, heads, MLP width)
        "minilm": (30522, 384, 6, 12, 1536),  # sentence-transformers/all-MiniLM-L6-v2
        "tiny": (500, 32, 2, 2, 64),
    }
    if name == "gpt2":
        config, cls = transformers.GPT2Config(), transformers.GPT2Model
    else:
        vocab, width, layers, heads, mlp = sizes[name]
        config = transformers.BertConfig(
            vocab_size=vocab,
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=mlp,
        )
        cls = transformers.BertModel
    with torch.device("meta"):
        model = cls(config)
    return {k: v.shape for k, v in model.named_parameters()}


def write_diagonal(path: Path, shapes: dict[str, Any], seed: int) -> int:
    """A diagonal curvature file of random positive float32 entries, 10^U(−9, 1); its bytes."""
    import torch

    import gradmerge as gm

    g = torch.Generator().manual_seed(seed)
    values = {k: 10.0 ** (torch.rand(s, generator=g) * 10 - 9) for k, s in shapes.items()}
    c = gm.Diagonal(values)
    c.meta["num_examples"] = "1000"
    c.save(path)
    return path.stat().st_size


def baseline(paths: list[str]) -> dict[str, Any]:
    """The plain process: load everything, numpy.percentile (float64) over it (numpy and
    safetensors only: no torch, no gradmerge)."""
    import numpy as np
    from safetensors.numpy import load_file

    qs = list(PERCENTILES.values())
    clock = time.perf_counter()
    seconds: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = round(now - clock, 3)
        clock = now

    files = [{k.removeprefix("diag/"): v for k, v in load_file(p).items()} for p in paths]
    lap("load")
    out: dict[str, Any] = {"files": []}
    for f in files:
        values = {k: v.astype(np.float64).reshape(-1) for k, v in f.items()}
        whole = np.percentile(np.concatenate(list(values.values())), qs)
        out["files"].append({"scale": whole.tolist()})
    lap("files")
    for f, report in zip(files, out["files"], strict=True):
        report["tensors"] = {
            k: np.percentile(v.astype(np.float64), qs).tolist() for k, v in f.items()
        }
    lap("tensors")
    keys = [k for k in files[0] if all(k in f for f in files)]
    total = np.concatenate([sum(f[k].astype(np.float64).reshape(-1) for f in files) for k in keys])
    p10, p90 = np.percentile(total[total > 0], [10, 90])
    out["window"] = [RHO / (1 - RHO) * p90, (1 - RHO) / RHO * p10]
    lap("window")
    out["seconds"] = seconds
    return out


def agreement(base: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """Whether every number of inspect's report equals the baseline's (exactly), and the
    largest relative difference."""
    worst, compared = 0.0, 0
    names = list(PERCENTILES)

    def compare(want: list[float], got: dict[str, Any]) -> None:
        nonlocal worst, compared
        for name, w in zip(names, want, strict=True):
            g = got[name]
            worst = max(worst, abs(g - w) / max(abs(w), 1e-300))
            compared += 1

    for want, got in zip(base["files"], report["files"], strict=True):
        compare(want["scale"], got["scale"])
        for layer in got["layers"]:
            (key,) = layer["keys"]
            compare(want["tensors"][key], layer["scale"])
    window = report["delta_window"]
    bounds = (window["not_fisher_from"], window["not_arithmetic_up_to"])
    for w, g in zip(base["window"], bounds, strict=True):
        worst = max(worst, abs(g - w) / abs(w))
        compared += 1
    return {"numbers": compared, "max_relative_difference": worst, "exact": worst == 0.0}


def measure(case: str, paths: list[Path], repeats: int, tmp: Path) -> dict[str, Any]:
    """Both sides, alternated, ``repeats`` times each."""
    files = [str(p) for p in paths]
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "inspect": []}
    base_numbers = report = None
    for r in range(repeats):
        for side in ("baseline", "inspect"):
            load_before = load()
            if side == "baseline":
                out = tmp / "baseline.json"
                cmd = module_argv("inspect_files", "--baseline", str(out), *files)
            else:
                out = tmp / "inspect.json"
                out.unlink(missing_ok=True)  # gradmerge inspect refuses to replace a file
                cmd = [sys.executable, "-m", "gradmerge", "inspect", *files, "--json", str(out)]
            result = run_measured(cmd)
            if result["returncode"] != 0:
                raise RuntimeError(f"{side} failed: {result.get('error')}")
            row = {
                "wall_seconds": round(result["wall_seconds"], 3),
                "peak_rss_bytes": result["peak_rss_bytes"],
                "peak_rss_anon_bytes": result["peak_rss_anon_bytes"],
                "load_before": load_before,
            }
            runs[side].append(row)
            print(
                f"  {case} {side} run {r + 1}: {row['wall_seconds']:.2f} s, "
                f"{row['peak_rss_bytes'] / 2**20:.0f} MiB "
                f"({row['peak_rss_anon_bytes'] / 2**20:.0f} MiB anonymous), load {load_before[0]:.2f}",
                flush=True,
            )
            numbers = json.loads(out.read_text())
            if side == "baseline":
                row["phases_seconds"] = numbers["seconds"]  # inside the process
                base_numbers = base_numbers or numbers
            else:
                report = report or numbers
    assert base_numbers is not None and report is not None
    best = {side: min(rows, key=lambda x: x["wall_seconds"]) for side, rows in runs.items()}
    return {
        "files": [{"path": p.name, "bytes": p.stat().st_size} for p in paths],
        "runs": runs,
        "best": best,
        "ratio": round(best["inspect"]["wall_seconds"] / best["baseline"]["wall_seconds"], 3),
        "rss_ratio": round(
            best["inspect"]["peak_rss_bytes"] / best["baseline"]["peak_rss_bytes"], 3
        ),
        "agreement": agreement(base_numbers, report),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small layouts (a smoke run)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side (best taken)")
    p.add_argument(
        "--out",
        type=Path,
        help="report path (default benchmarks/results/inspect-cpu.json; --quick: a temporary folder)",
    )
    p.add_argument("--baseline", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("files", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.baseline:  # the child process of the baseline side
        Path(args.baseline).write_text(json.dumps(baseline(args.files)))
        return
    out = output(args.out, quick=args.quick, default=RESULTS / "inspect-cpu.json", name="inspect")
    cases = {
        "minilm": ("tiny" if args.quick else "minilm", 2),
        "gpt2": ("tiny" if args.quick else "gpt2", 1),
    }
    tmp = Path(tempfile.mkdtemp(prefix="gm-inspect-bench-"))
    run = Run("inspect_files", settings=vars(args))
    report: dict[str, Any] = {"cases": {}}
    try:
        for case, (model, count) in cases.items():
            shapes = layout(model)
            paths = [tmp / f"{case}-{i}.curvature.safetensors" for i in range(count)]
            for i, path in enumerate(paths):
                write_diagonal(path, shapes, seed=i)
            print(
                f"{case}: {count} file(s) of {sum(s.numel() for s in shapes.values()):,} entries",
                flush=True,
            )
            result = measure(case, paths, args.repeats, tmp)
            result["parameters"] = sum(s.numel() for s in shapes.values())
            report["cases"][case] = result
            print(
                f"  {case}: inspect/baseline {result['ratio']}x wall, {result['rss_ratio']}x peak RSS, "
                f"agreement {result['agreement']}",
                flush=True,
            )
            for path in paths:
                path.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_result(out, run.finish(report))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
