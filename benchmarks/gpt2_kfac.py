"""GPT-2-124M end to end through the command line: K-FAC curvature estimation and K-FAC
gradient-matching merges of 2 and 4 tasks, with the diagonal merge and mergekit's task
arithmetic in the same run.

Setup (everything built here, nothing downloaded): GPT-2-124M from its config (random weights,
seed 0, Hugging Face ``GPT2LMHeadModel``, saved with ``save_pretrained``); T "fine-tunes", each
the base plus N(0, 0.02²) noise; for each task a token file of ``--sequences`` × ``--length``
random ids drawn from its own quarter of the vocabulary (so the tasks' K-FAC factors differ).

Measured, each command in a fresh process (wall time and peak anonymous memory sampled every
5 ms):

1. ``gradmerge curvature ft_t tokens_t --structure kfac --shift-labels`` per task, and
   ``--structure diag`` for the first two, as a ratio to one forward+backward pass over the same
   tokens measured in this process (target ≤ 2× for K-FAC); first ``--rounds`` interleaved
   rounds of one forward+backward pass and one K-FAC estimation of task 0 (the median ratio and
   its spread; ``--estimate-only``: only those);
2. ``gradmerge merge`` with ``method: gradient_matching``, K-FAC curvatures and
   ``prior: {delta: δ}`` for T = 2 and T = 4 (targets: ≤ 120 s and ≤ 240 s wall, ≤ 2 GiB peak
   anonymous memory), with the largest certified relative residual and the CG iterations from
   the merge record;
   and, before each, the same merge with ``solver: {approximate: true, maxiter: M}`` for each
   ``--approximate M`` (default 0: the eigenbasis preconditioner alone), with every layer's
   measured residual (``--skip-exact``: only those);
3. the same merge with diagonal curvatures, and ``gradmerge merge`` / ``mergekit-yaml`` task
   arithmetic of the same models.

    python -m benchmarks.gpt2_kfac            # writes benchmarks/results/gpt2-kfac-cpu.json

``--per-layer LAYER [...] --keep FOLDER`` instead solves single layers of block 0 (e.g.
``attn.c_proj``) from a kept folder's K-FAC files at several δ (``--relative-delta``, relative to
the layer's largest ‖A_t‖₂‖G_t‖₂): CG iterations, certified residual and wall time per solve,
the PSD checks' time, and one factor-sized GEMM as the machine's yardstick in the same run
(``results/gpt2-kfac-layers-cpu.json``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

from benchmarks.merge import machine, run_measured

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "gpt2-kfac-cpu.json"
GRADMERGE = str(Path(sys.executable).parent / "gradmerge")
MERGEKIT = str(Path(sys.executable).parent / "mergekit-yaml")


def build(folder: Path, tasks: int, sequences: int, length: int) -> dict[str, Any]:
    """Base, ``tasks`` noisy copies and one token file per task."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config()
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(folder / "base")
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    models, data = [], []
    quarter = config.vocab_size // 4
    for t in range(tasks):
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(base[k] + 0.02 * torch.randn(p.shape, generator=g))
        model.save_pretrained(folder / f"ft{t}")
        models.append(folder / f"ft{t}")
        low = (t % 4) * quarter
        ids = torch.randint(low, low + quarter, (sequences, length), generator=g)
        path = folder / f"tokens{t}.safetensors"
        save_file({"input_ids": ids, "labels": ids.clone()}, path)
        data.append(path)
    return {"base": folder / "base", "models": models, "data": data}


class ForwardBackward:
    """The yardstick: one forward+backward pass over a token file (summed loss, batches of
    ``batch``), in this process, on the model loaded once."""

    def __init__(self, model_dir: Path, data: Path, batch: int) -> None:
        import transformers
        from safetensors.torch import load_file

        self.model = transformers.GPT2LMHeadModel.from_pretrained(model_dir).eval()
        self.ids, self.batch = load_file(data)["input_ids"], batch
        self.seconds()  # warm-up

    def seconds(self) -> float:
        start = time.perf_counter()
        for i in range(0, len(self.ids), self.batch):
            x = self.ids[i : i + self.batch]
            logits = self.model(input_ids=x).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            loss.backward()
        self.model.zero_grad(set_to_none=True)
        return time.perf_counter() - start


def interleaved_ratio(
    yardstick: ForwardBackward, paths: dict[str, Any], folder: Path, rounds: int, batch: int
) -> dict[str, Any]:
    """``rounds`` × (one forward+backward here, then ``gradmerge curvature --structure kfac`` of
    task 0 in a fresh process): each round's ratio, their median and spread. Interleaved, so
    that a change in the machine's load reaches both sides of a ratio alike."""
    out = folder / "ratio.kfac.safetensors"
    rows = []
    for r in range(rounds):
        out.unlink(missing_ok=True)  # each round writes anew (the CLI refuses an existing OUT)
        fb = yardstick.seconds()
        cli = curvature(paths["models"][0], paths["data"][0], out, "kfac", batch)
        if cli.get("returncode"):  # a failed estimate has no cost to compare: stop, say why
            raise RuntimeError(f"round {r}: gradmerge curvature failed: {cli.get('error')}")
        row = {"forward_backward_seconds": fb, "cli_seconds": cli["wall_seconds"]}
        row["ratio"] = cli["wall_seconds"] / fb
        rows.append(row)
        print(
            f"round {r}: forward+backward {fb:.1f} s, CLI K-FAC {row['cli_seconds']:.1f} s, "
            f"ratio {row['ratio']:.2f}",
            flush=True,
        )
    out.unlink(missing_ok=True)
    ratios = sorted(row["ratio"] for row in rows)
    return {
        "rounds": rows,
        "median_ratio": statistics.median(ratios),
        "min_ratio": ratios[0],
        "max_ratio": ratios[-1],
    }


def curvature(model: Path, data: Path, out: Path, structure: str, batch: int) -> dict[str, Any]:
    cmd = [GRADMERGE, "curvature", str(model), str(data), str(out), "--structure", structure]
    cmd += ["--shift-labels", "--batch-size", str(batch), "--no-progress"]
    return run_measured(cmd)


def merge(folder: Path, name: str, config: dict[str, Any]) -> dict[str, Any]:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    out = folder / f"out_{name}"
    result = run_measured([GRADMERGE, "merge", str(path), str(out), "--no-progress"])
    record = out / "gradmerge_merge.json"
    if record.exists():
        rec = json.loads(record.read_text())
        solves = rec.get("solves", {})
        result["max_residual"] = rec.get("max_residual")
        result["cg_iterations"] = sum(s["iterations"] for s in solves.values())
        result["solved_layers"] = len(solves)
        result["methods"] = sorted({s["method"] for s in solves.values()})
        result["residuals"] = {k: s["residual"] for k, s in solves.items()}
        result["layers_above_tol"] = sum(not s.get("success", True) for s in solves.values())
    shutil.rmtree(out, ignore_errors=True)
    return result


def gradient_matching(
    folder: Path, paths: dict[str, Any], structure: str, tasks: int, delta: float
) -> dict[str, Any]:
    """The merge config of the first ``tasks`` models with their ``structure`` curvatures."""
    return {
        "method": "gradient_matching",
        "base_model": str(paths["base"]),
        "models": [
            {
                "model": str(paths["models"][t]),
                "curvature": str(folder / f"ft{t}.{structure}.safetensors"),
            }
            for t in range(tasks)
        ],
        "prior": {"delta": delta},
    }


def mergekit(folder: Path, paths: dict[str, Any], tasks: int) -> dict[str, Any]:
    config = {
        "merge_method": "task_arithmetic",
        "base_model": str(paths["base"]),
        "models": [
            {"model": str(m), "parameters": {"weight": 1.0}} for m in paths["models"][:tasks]
        ],
        "dtype": "float32",
    }
    path = folder / "mergekit.yaml"
    path.write_text(yaml.safe_dump(config))
    out = folder / "out_mergekit"
    result = run_measured([MERGEKIT, str(path), str(out), "--lazy-unpickle"])
    shutil.rmtree(out, ignore_errors=True)
    return result


def per_layer(folder: Path, layers: list[str], deltas: list[float], tasks: int) -> list[dict]:
    """Solve δI + Σ_t A_t ⊗ G_t for single layers of block 0 (see the module docstring)."""
    from safetensors import safe_open

    import gradmerge as gm
    from gradmerge.solvers import kfac_cg

    files = [safe_open(str(folder / f"ft{t}.kfac.safetensors"), "pt") for t in range(tasks)]
    rows = []
    for layer in layers:
        key = f"blocks0/kfac/transformer.h.0.{layer}/0"
        terms = [(f.get_tensor(f"{key}/A"), f.get_tensor(f"{key}/G")) for f in files]
        start = time.perf_counter()
        for a, g in terms:
            gm.KFAC({layer: (a, g)}, bias=[layer]).check_psd(name=layer)
        psd = time.perf_counter() - start
        big = max(terms[0][0].shape[0], terms[0][1].shape[0])
        m = torch.randn(big, big)
        start = time.perf_counter()
        m @ m
        gemm = time.perf_counter() - start
        scale = max(
            float(torch.linalg.matrix_norm(a.double(), 2) * torch.linalg.matrix_norm(g.double(), 2))
            for a, g in terms
        )
        b = torch.randn(
            terms[0][1].shape[0], terms[0][0].shape[0], generator=torch.Generator().manual_seed(0)
        )
        for rel in deltas:
            start = time.perf_counter()
            s = kfac_cg.solve(layer, rel * scale, terms, b)
            row = {
                "layer": layer,
                "A_side": terms[0][0].shape[0],
                "G_side": terms[0][1].shape[0],
                "tasks": tasks,
                "delta_relative": rel,
                "solve_seconds": time.perf_counter() - start,
                "psd_check_seconds": psd,
                "gemm_seconds_largest_side": gemm,
                "cg_iterations": s.iterations,
                "residual": s.residual,
                "method": s.method,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def show(label: str, r: dict[str, Any]) -> None:
    if r.get("returncode"):
        print(f"{label:44s} FAILED: {r.get('error')}", flush=True)
        return
    extra = ""
    if "max_residual" in r and r["max_residual"] is not None:
        extra = f", max residual {r['max_residual']:.1e}, {r['cg_iterations']} CG iterations"
        if r.get("layers_above_tol"):
            extra += f", {r['layers_above_tol']}/{r['solved_layers']} layers above tol"
    print(
        f"{label:44s} {r['wall_seconds']:7.1f} s wall, peak anon "
        f"{r['peak_rss_anon_bytes'] / 2**30:.2f} GiB{extra}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--delta", type=float, nargs="+", default=[1e-3])
    parser.add_argument(
        "--approximate",
        type=int,
        nargs="*",
        default=[0],
        metavar="MAXITER",
        help="also merge with solver: {approximate: true, maxiter: MAXITER} (none: skip)",
    )
    parser.add_argument("--skip-exact", action="store_true", help="only the approximate merges")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds of forward+backward and CLI K-FAC estimation of task 0 "
        "(median ratio and spread; 0: none)",
    )
    parser.add_argument(
        "--estimate-only", action="store_true", help="only the interleaved ratio rounds"
    )
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--keep", type=Path, default=None, help="build in this folder, keep it")
    parser.add_argument("--per-layer", nargs="+", default=None, metavar="LAYER")
    parser.add_argument("--relative-delta", type=float, nargs="+", default=[1e-6, 1e-4, 1e-2])
    args = parser.parse_args(argv)
    if args.per_layer:
        if args.keep is None:
            parser.error("--per-layer reads the K-FAC files of a --keep folder")
        rows = per_layer(args.keep, args.per_layer, args.relative_delta, min(args.tasks))
        out = args.out if args.out != RESULT else RESULT.with_name("gpt2-kfac-layers-cpu.json")
        report = {"machine": machine(), "rows": rows}
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}")
        return 0
    most = max(args.tasks)
    folder = args.keep or Path(tempfile.mkdtemp(prefix="gpt2-kfac-"))
    folder.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"machine": machine(), "settings": vars(args) | {"out": str(args.out)}}
    report["settings"]["keep"] = str(args.keep) if args.keep else None
    try:
        if not all((folder / f"ft{t}").exists() for t in range(most)):
            # deterministic: a kept folder's earlier models are rebuilt bit-identical
            paths = build(folder, most, args.sequences, args.length)
        else:  # a kept folder from an earlier run
            paths = {
                "base": folder / "base",
                "models": [folder / f"ft{t}" for t in range(most)],
                "data": [folder / f"tokens{t}.safetensors" for t in range(most)],
            }
        tokens = args.sequences * args.length
        report["tokens_per_task"] = tokens
        todo = [
            (structure, t)
            for structure, count in (("kfac", most), ("diag", 2))
            for t in range(count)
            if not (folder / f"ft{t}.{structure}.safetensors").exists()
        ]
        est: dict[str, Any] = {}
        if todo or args.rounds:  # the ratio's yardstick, only when something is estimated
            yardstick = ForwardBackward(paths["models"][0], paths["data"][0], args.batch_size)
            fb = statistics.median(yardstick.seconds() for _ in range(2))
            report["forward_backward_seconds"] = fb
            print(f"forward+backward over {tokens} tokens: {fb:.1f} s", flush=True)
        if args.rounds:
            report["kfac_estimation_ratio"] = interleaved_ratio(
                yardstick, paths, folder, args.rounds, args.batch_size
            )
            save(args.out, report)
        if args.estimate_only:
            todo = []
        for structure, t in todo:
            out = folder / f"ft{t}.{structure}.safetensors"
            r = curvature(paths["models"][t], paths["data"][t], out, structure, args.batch_size)
            r["ratio_to_forward_backward"] = r["wall_seconds"] / fb
            r["file_bytes"] = out.stat().st_size if out.exists() else None
            est[f"{structure} task {t}"] = r
            show(f"curvature {structure} task {t}", r)
        report["estimation"] = est
        if args.estimate_only:
            save(args.out, report)
            print(f"wrote {args.out}")
            return 0
        merges: dict[str, Any] = {}
        report["merges"] = merges  # saved after each merge: a long run keeps what it measured
        for tasks in args.tasks:
            for delta in args.delta:
                config = gradient_matching(folder, paths, "kfac", tasks, delta)
                label = f"K-FAC gradient matching T={tasks} delta={delta:g}"
                if not args.skip_exact:
                    merges[label] = merge(folder, f"kfac{tasks}_{delta:g}", config)
                    show(label, merges[label])
                    save(args.out, report)
                for maxiter in args.approximate:
                    solver = {"solver": {"approximate": True, "maxiter": maxiter}}
                    name = f"{label}, approximate maxiter={maxiter}"
                    merges[name] = merge(
                        folder, f"kfac{tasks}_{delta:g}_approx{maxiter}", config | solver
                    )
                    show(name, merges[name])
                    save(args.out, report)
        diag = gradient_matching(folder, paths, "diag", 2, args.delta[0])
        merges["diagonal gradient matching T=2"] = merge(folder, "diag2", diag)
        show("diagonal gradient matching T=2", merges["diagonal gradient matching T=2"])
        ta = {
            "method": "task_arithmetic",
            "base_model": str(paths["base"]),
            "models": [{"model": str(paths["models"][t])} for t in range(2)],
        }
        merges["gradmerge task arithmetic T=2"] = merge(folder, "ta2", ta)
        show("gradmerge task arithmetic T=2", merges["gradmerge task arithmetic T=2"])
        merges["mergekit task arithmetic T=2"] = mergekit(folder, paths, 2)
        show("mergekit task arithmetic T=2", merges["mergekit task arithmetic T=2"])
    finally:
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)
    save(args.out, report)
    print(f"wrote {args.out}")
    return 0


def save(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
