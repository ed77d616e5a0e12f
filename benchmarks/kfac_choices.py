"""Each K-FAC solve choice on real GPT-2-124M merge systems: CG iterations, Kronecker products by
precision, certified residual and wall time per layer, for the solver settings of
:class:`gradmerge.KroneckerCG`.

The systems are the merge's own (Eq. 6 with H_0 = δI, α_t = 1): per layer
H̄ = δI + Σ_t A_t ⊗ G_t and b = Σ_t (δ τ_t + G_t τ_t A_t), τ_t = θ_t − θ_LLM, read from a folder
kept by ``python -m benchmarks.gpt2_kfac --keep DIR`` (factors estimated from its token files, not
synthetic); the warm start is the task-arithmetic solution Σ_t τ_t.

Choices: ``working`` (float32 products, cold start: the preconditioner's solve), ``warm``
(float32, warm start), ``bfloat16`` (bfloat16 products under the float32 refinement, warm
start), ``approximate-0`` / ``approximate-10`` (``approximate: true`` with that ``maxiter``),
and the low-rank reduction wherever it applies (reported in the method). Wall times on a shared
machine move with its load: the script records the load average and the time of one
float32 and one bfloat16 application of the layer's operator in the same run, so the products
counted can be priced on any machine.

    python -m benchmarks.kfac_choices --keep DIR --delta 6 --layers 0.mlp.c_fc 0.attn.c_proj \\
        --out benchmarks/results/kfac-choices-cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from benchmarks.record import Run, load, write_result
from gradmerge.solvers import kfac_cg
from gradmerge.solvers.spec import KroneckerCG

CHOICES: dict[str, KroneckerCG] = {
    "working": KroneckerCG(arithmetic="working", warm_start=False),
    "warm": KroneckerCG(arithmetic="working", warm_start=True),
    "bfloat16": KroneckerCG(arithmetic="bfloat16", warm_start=True),
    "approximate-0": KroneckerCG(approximate=True, maxiter=0),
    "approximate-10": KroneckerCG(approximate=True, maxiter=10),
}


def _weight(folder: Path, name: str) -> Tensor:
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as h:
            if name in h.keys():  # noqa: SIM118 - safe_open has no __contains__
                return h.get_tensor(name)
    raise KeyError(name)


def system(folder: Path, tasks: int, layer: str, delta: float) -> dict[str, Any]:
    """δ, the terms, b and the warm start of one layer (``"0.mlp.c_fc"``: block 0's c_fc)."""
    block, module = layer.split(".", 1)
    name = f"transformer.h.{block}.{module}"
    terms = []
    for t in range(tasks):
        with safe_open(str(folder / f"ft{t}.kfac.safetensors"), "pt") as f:
            key = next(k for k in f.keys() if k.endswith(f"/{name}/0/A"))  # noqa: SIM118
            terms.append((f.get_tensor(key), f.get_tensor(key[:-1] + "G")))
    base = _matrix(folder / "base", name)
    taus = [_matrix(folder / f"ft{t}", name) - base for t in range(tasks)]
    b = sum((delta * tau + g @ tau @ a for (a, g), tau in zip(terms, taus, strict=True)))
    return {"terms": terms, "b": b, "x0": sum(taus), "name": name}


def _matrix(model: Path, name: str) -> Tensor:
    """[Wᵀ | b] of a Conv1D (stored (in, out)): the (out, in + 1) matrix of the K-FAC layout."""
    w, bias = _weight(model, f"{name}.weight"), _weight(model, f"{name}.bias")
    return torch.cat([w.T, bias[:, None]], dim=1).contiguous()


def count_products() -> dict[str, int]:
    """Count the operator applications of :class:`kfac_cg.Basis` by precision."""
    counts = {"float32": 0, "bfloat16": 0}
    apply, low = kfac_cg.Basis._apply, kfac_cg.Basis._apply_low

    def counted(self: kfac_cg.Basis, y: Tensor) -> Tensor:
        counts["float32"] += 1
        return apply(self, y)

    def counted_low(self: kfac_cg.Basis, y: Tensor) -> Tensor:
        counts["bfloat16"] += 1
        return low(self, y)

    kfac_cg.Basis._apply = counted  # type: ignore[method-assign]
    kfac_cg.Basis._apply_low = counted_low  # type: ignore[method-assign]
    return counts


def yardstick(terms: list, b: Tensor) -> dict[str, float]:
    """Seconds of one application Σ_k G_k X A_k in float32 and in bfloat16 (median of 3)."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        ts = [(a.to(dtype), g.to(dtype)) for a, g in terms]
        x = b.to(dtype)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            sum(g @ x @ a for a, g in ts)
            times.append(time.perf_counter() - start)
        out[str(dtype).removeprefix("torch.")] = sorted(times)[1]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, required=True)
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--delta", type=float, required=True)
    parser.add_argument("--layers", nargs="+", default=["0.mlp.c_fc", "0.attn.c_proj"])
    parser.add_argument("--choices", nargs="+", default=list(CHOICES), choices=list(CHOICES))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    run = Run("kfac_choices", settings=vars(args), argv=argv)
    counts = count_products()
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {"rows": rows, "complete": False}  # written after every row
    for layer in args.layers:
        s = system(args.keep, args.tasks, layer, args.delta)
        stick = yardstick(s["terms"], s["b"])
        for choice in args.choices:
            spec = CHOICES[choice]
            counts.update(float32=0, bfloat16=0)
            load_before = load()
            start = time.perf_counter()
            solved = kfac_cg.solve(s["name"], args.delta, s["terms"], s["b"], spec, x0=s["x0"])
            row = {
                "layer": layer,
                "shape": list(s["b"].shape),
                "choice": choice,
                "method": solved.method,
                "iterations": solved.iterations,
                "residual": solved.residual,
                "success": solved.success,
                "products_float32": counts["float32"],
                "products_bfloat16": counts["bfloat16"],
                "wall_seconds": time.perf_counter() - start,
                "apply_seconds": stick,
                "load_before": load_before,
                "load_after": load(),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_result(args.out, run.finish(report))
    report["complete"] = True
    write_result(args.out, run.finish(report))
    return 0


Tensor = torch.Tensor

if __name__ == "__main__":
    raise SystemExit(main())
