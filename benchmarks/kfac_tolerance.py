"""How loose may a K-FAC merge's solver tolerance be? GPT-2-124M merged at several ``solver:
{tol}`` settings (and ``approximate``), each merged model's logits on held-out tokens compared
with those of the tightest merge.

Inputs: a folder kept by ``python -m benchmarks.gpt2_kfac --keep DIR`` (base, fine-tunes ``ft{t}`` and their
``ft{t}.kfac.safetensors``). For each setting, one ``gradmerge merge`` in a fresh process (wall
time, largest certified residual, CG iterations from ``gradmerge_merge.json``); then each merged
model's logits on ``--sequences`` held-out sequences of each task's vocabulary quarter (drawn
with a seed the curvature's tokens did not use), against the reference (the first ``--tol``):

- ``max_abs_logit_change``: max |Δ logit| over every position and vocabulary entry;
- ``relative_logit_change``: ‖Δ logits‖ / ‖logits_ref − logits_base‖ (the change against how far
  the merge moved the logits from the base model's);
- ``top1_agreement``: fraction of positions whose arg-max token equals the reference's;
- ``kl_mean``: mean KL(p_ref ‖ p) per position, in nats;
- ``parameter_change``: ‖θ − θ_ref‖ / ‖θ_ref − θ_base‖ over the merged tensors.

    python -m benchmarks.kfac_tolerance --keep DIR --delta 6 --tol 1e-5 1e-4 1e-3 1e-2 \
        --approximate 0          # writes benchmarks/results/kfac-tolerance-cpu.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from benchmarks.record import RESULTS, Run, run_measured, write_result

RESULT = RESULTS / "kfac-tolerance-cpu.json"
GRADMERGE = str(Path(sys.executable).parent / "gradmerge")
ARITHMETIC_ROWS = {"float32": "working", "bfloat16": "bfloat16"}
"""Options that add rows whose Kronecker products run in one arithmetic, whatever ``auto`` would
pick (the ``--tol`` rows take the default, ``auto``): option → ``solver: {arithmetic}``. The
rows' names (``tol=1e-05, float32 products``) are those ``benchmarks.scale --calibrate`` reads."""


def merge(folder: Path, name: str, config: dict[str, Any]) -> tuple[dict[str, Any], Path]:
    """``gradmerge merge`` of ``config`` into ``folder/tol_name`` (kept for the logits)."""
    path = folder / f"tol_{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    out = folder / f"tol_{name}"
    shutil.rmtree(out, ignore_errors=True)
    result = run_measured([GRADMERGE, "merge", str(path), str(out), "--no-progress"])
    record = out / "gradmerge_merge.json"
    if record.exists():
        solves = json.loads(record.read_text()).get("solves", {})
        residuals = [s["residual"] for s in solves.values()]
        result["max_residual"] = max(residuals, default=None)
        result["median_residual"] = sorted(residuals)[len(residuals) // 2] if residuals else None
        result["cg_iterations"] = sum(s["iterations"] for s in solves.values())
        result["layers_above_1e-5"] = sum(r > 1e-5 for r in residuals)
    return result, out


def held_out(vocab: int, tasks: int, sequences: int, length: int) -> torch.Tensor:
    """``sequences`` sequences per task from its vocabulary quarter, seed 7 (the benchmark's
    curvature tokens use seed 1)."""
    g = torch.Generator().manual_seed(7)
    quarter = vocab // 4
    rows = [
        torch.randint((t % 4) * quarter, (t % 4 + 1) * quarter, (sequences, length), generator=g)
        for t in range(tasks)
    ]
    return torch.cat(rows)


@torch.no_grad()
def logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    return torch.cat([model(input_ids=ids[i : i + 4]).logits for i in range(0, len(ids), 4)])


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def compare(
    ref: torch.Tensor, base: torch.Tensor, other: torch.Tensor, theta: dict[str, Any]
) -> dict[str, float]:
    diff = (other - ref).double()
    logp_ref, logp = ref.double().log_softmax(-1), other.double().log_softmax(-1)
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
    return {
        "max_abs_logit_change": float(diff.abs().max()),
        "relative_logit_change": float(diff.norm() / (ref - base).double().norm()),
        "top1_agreement": float((other.argmax(-1) == ref.argmax(-1)).double().mean()),
        "kl_mean": float(kl.mean()),
        "parameter_change": theta["change"],
    }


def parameter_change(
    ref: dict[str, torch.Tensor], base: dict[str, torch.Tensor], other: dict[str, torch.Tensor]
) -> float:
    num = den = 0.0
    for k, v in ref.items():
        if k in base and k in other:
            num += float((other[k].double() - v.double()).square().sum())
            den += float((v.double() - base[k].double()).square().sum())
    return (num / den) ** 0.5 if den else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, required=True, help="a gpt2_kfac.py --keep folder")
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--delta", type=float, default=6.0)
    parser.add_argument("--tol", type=float, nargs="+", default=[1e-5, 1e-4, 1e-3, 1e-2])
    parser.add_argument("--approximate", type=int, nargs="*", default=[0], metavar="MAXITER")
    for name, arithmetic in ARITHMETIC_ROWS.items():
        parser.add_argument(
            f"--{name}",
            type=float,
            nargs="*",
            default=[],
            metavar="TOL",
            help=f"also merge with solver: {{tol: TOL, arithmetic: {arithmetic}}}",
        )
    parser.add_argument("--sequences", type=int, default=4, help="held-out sequences per task")
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    folder = args.keep
    config: dict[str, Any] = {
        "method": "gradient_matching",
        "base_model": str(folder / "base"),
        "models": [
            {"model": str(folder / f"ft{t}"), "curvature": str(folder / f"ft{t}.kfac.safetensors")}
            for t in range(args.tasks)
        ],
        "prior": {"delta": args.delta},
    }
    settings = [(f"tol={tol:g}", {"tol": tol}) for tol in args.tol]
    settings += [
        (f"tol={tol:g}, {name} products", {"tol": tol, "arithmetic": arithmetic})
        for name, arithmetic in ARITHMETIC_ROWS.items()
        for tol in getattr(args, name)
    ]
    settings += [
        (f"approximate maxiter={m}", {"approximate": True, "maxiter": m}) for m in args.approximate
    ]
    run = Run("kfac_tolerance", settings=vars(args), argv=argv)
    report: dict[str, Any] = {"complete": False}  # written after every setting
    import transformers

    vocab = transformers.GPT2Config.from_pretrained(folder / "base").vocab_size
    ids = held_out(vocab, args.tasks, args.sequences, args.length)
    report["held_out_tokens"] = ids.numel()
    base_logits, base_theta = logits(folder / "base", ids), weights(folder / "base")
    rows, ref = [], None
    for name, solver in settings:
        safe = name.replace(" ", "_").replace(",", "")
        result, out = merge(folder, safe, config | {"solver": solver})
        row = {"setting": name, "solver": solver, **result}
        if result["returncode"] == 0:
            out_logits, theta = logits(out, ids), weights(out)
            if ref is None:
                ref = (out_logits, theta)
            change = parameter_change(ref[1], base_theta, theta)
            row |= compare(ref[0], base_logits, out_logits, {"change": change})
            shutil.rmtree(out, ignore_errors=True)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "residuals"}), flush=True)
        report["rows"] = rows
        write_result(args.out, run.finish(report))
    report["complete"] = True
    write_result(args.out, run.finish(report))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
