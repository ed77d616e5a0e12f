"""K-FAC solves with more than two Kronecker terms: CG iterations and wall time per layer for
earlier preconditioners and for the solver gradmerge uses (gradmerge/solvers/kfac_cg.py).

The system per layer is the merge's H̄ = δ·I + Σ_k A_k ⊗ G_k (two or three tasks), solved to the
default float64 tolerance (relative residual 1e-10). Preconditioners compared, each an exact
two-term (or one-term) Kronecker solve inside the same CG:

- ``before``: the previous one, (mean over ALL terms of A, δ's I included) ⊗ (Σ G + δI);
- ``pi``: δ·I folded into the task terms with π-damping (Martens & Grosse 2015),
  Σ_k (A_k + π_k √(δ/m) I) ⊗ (G_k + √(δ/m)/π_k I), for two tasks (two terms; exact solve);
- ``anchor``: δ·I exact + the tasks as one normalised Kronecker term (P_a, the exact two-term
  solve of δI + Ā ⊗ Ḡ, Ā = mean of A_k/‖A_k‖_F, Ḡ = Σ_k ‖A_k‖_F G_k);
- ``after``: what ``gm.KFAC`` now does: CG in the eigenbasis of Ā and Ḡ preconditioned by the
  exact diagonal of the system there (the certified residual recomputed in the original basis).

Workloads: (a) random SPD factors with decaying spectra (eigenvalues 10^(−6 t), t ∈ [0, 1]) for
tasks that are related (task 2's eigenbasis a small rotation of task 1's) or independent (unrelated
eigenbases); (b) K-FAC factors from ``gm.estimate_curvature(..., structure="kfac")`` of a tiny
GPT-2 (random weights) on two (three) random token "tasks" drawn from different vocabulary ranges.
δ is relative to the layer's scale max_k ‖A_k‖‖G_k‖. One thread (the machine is shared).

    python -m benchmarks.kfac_solve         # ~15 minutes on one thread; writes benchmarks/results/kfac-solve-cpu.json
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

import gradmerge as gm
from benchmarks.record import RESULTS, Run, write_result
from gradmerge.errors import NotConvergedError
from gradmerge.solvers import kronecker
from gradmerge.solvers.cg import solve_or_raise

RESULT = RESULTS / "kfac-solve-cpu.json"
DT = torch.float64
DELTAS = (1e-6, 1e-4, 1e-2, 1e-1)
MAXITER = 2000

Term = tuple[torch.Tensor, torch.Tensor]


def _eye(n: int) -> torch.Tensor:
    return torch.eye(n, dtype=DT)


def before(terms: list[Term], delta: float) -> list[Term]:
    allt = [*terms, (_eye(terms[0][0].shape[0]), delta * _eye(terms[0][1].shape[0]))]
    return [(sum(a for a, _ in allt) / len(allt), sum(g for _, g in allt))]


def pi_damped(terms: list[Term], delta: float) -> list[Term]:
    s = math.sqrt(delta / len(terms))
    out = []
    for a, g in terms:
        pi = math.sqrt((float(a.trace()) / a.shape[0]) / (float(g.trace()) / g.shape[0]))
        out.append((a + pi * s * _eye(a.shape[0]), g + s / pi * _eye(g.shape[0])))
    return out


def cg_with(terms: list[Term], delta: float, prec_terms: list[Term], b: torch.Tensor) -> dict:
    allt = [*terms, (_eye(terms[0][0].shape[0]), delta * _eye(terms[0][1].shape[0]))]
    t0 = time.perf_counter()
    parts = kronecker.factorise("bench", prec_terms)

    def apply(v: dict) -> dict:
        return {"x": sum(g @ v["x"] @ a for a, g in allt)}

    def prec(v: dict) -> dict:
        return {"x": kronecker.apply_inverse(parts, v["x"])}

    try:
        r = solve_or_raise(apply, {"x": b}, gm.CG(maxiter=MAXITER), precondition=prec, what="")
        its, res = r.iterations, r.residual
    except NotConvergedError:
        its, res = None, float("nan")  # did not converge within MAXITER
    return {"iterations": its, "seconds": time.perf_counter() - t0, "residual": res}


def after(terms: list[Term], delta: float, b: torch.Tensor) -> dict:
    k = gm.KFAC({"m": list(terms)}) + delta
    t0 = time.perf_counter()
    try:
        part = k.solve_info({"m.weight": b}, gm.KroneckerCG(maxiter=MAXITER)).parts["m"]
    except NotConvergedError:
        return {"iterations": None, "seconds": time.perf_counter() - t0, "residual": float("nan")}
    return {
        "iterations": part.iterations,
        "seconds": time.perf_counter() - t0,
        "residual": part.residual,
        "method": part.method,
    }


def anchor(terms: list[Term], delta: float) -> list[Term]:
    norms = [float(torch.linalg.matrix_norm(a)) for a, _ in terms]
    a_bar = sum(a / n for (a, _), n in zip(terms, norms, strict=True)) / len(terms)
    g_bar = sum(n * g for (_, g), n in zip(terms, norms, strict=True))
    return [(_eye(terms[0][0].shape[0]), delta * _eye(terms[0][1].shape[0])), (a_bar, g_bar)]


def compare(terms: list[Term], rel: float, seed: int) -> dict:
    scale = max(
        float(torch.linalg.matrix_norm(a, 2) * torch.linalg.matrix_norm(g, 2)) for a, g in terms
    )
    delta = rel * scale
    gen = torch.Generator().manual_seed(seed)
    b = torch.randn(terms[0][1].shape[0], terms[0][0].shape[0], dtype=DT, generator=gen)
    row = {
        "before": cg_with(terms, delta, before(terms, delta), b),
        "anchor": cg_with(terms, delta, anchor(terms, delta), b),
        "after": after(terms, delta, b),
    }
    if len(terms) == 2:
        row["pi"] = cg_with(terms, delta, pi_damped(terms, delta), b)
    return row


def decaying_spd(n: int, q: torch.Tensor) -> torch.Tensor:
    lam = 10.0 ** (-6 * torch.linspace(0, 1, n, dtype=DT))
    return (q * lam) @ q.T


def rotation(n: int, gen: torch.Generator, angle: float | None) -> torch.Tensor:
    """A random orthogonal matrix (``angle=None``), or exp(angle · S) for a random skew S."""
    m = torch.randn(n, n, dtype=DT, generator=gen)
    if angle is None:
        return torch.linalg.qr(m)[0]
    s = (m - m.T) / math.sqrt(2 * n)
    return torch.linalg.matrix_exp(angle * s)


def random_workload() -> list[dict]:
    rows = []
    for n_out, n_in in ((64, 64), (256, 128), (1024, 64)):
        for kind, angle in (("related", 0.3), ("independent", None)):
            if n_out == 1024 and kind == "independent":
                continue  # the 'before' runs to MAXITER here: minutes on one thread
            gen = torch.Generator().manual_seed(n_out + n_in)
            qa, qg = rotation(n_in, gen, None), rotation(n_out, gen, None)
            ra, rg = rotation(n_in, gen, angle), rotation(n_out, gen, angle)
            terms = [
                (decaying_spd(n_in, qa), decaying_spd(n_out, qg)),
                (decaying_spd(n_in, ra @ qa), 3.0 * decaying_spd(n_out, rg @ qg)),
            ]
            for rel in DELTAS if n_out < 1024 else (1e-4, 1e-2):
                row = compare(terms, rel, seed=1)
                rows.append(
                    {"workload": f"random {kind}", "shape": [n_out, n_in], "delta": rel, **row}
                )
                print(_fmt(rows[-1]), flush=True)
    return rows


def gpt2_workload(tasks: int) -> list[dict]:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    cfg.bos_token_id = cfg.eos_token_id = 0
    model = transformers.GPT2LMHeadModel(cfg).to(DT).eval()
    ranges = [(0, 160), (96, 256), (40, 200)][:tasks]
    ks = []
    for seed, (lo, hi) in enumerate(ranges, start=1):
        gen = torch.Generator().manual_seed(seed)
        data = []
        for _ in range(4):
            ids = torch.randint(lo, hi, (4, 32), generator=gen)
            data.append({"input_ids": ids, "labels": ids})
        c = gm.estimate_curvature(model, data, structure="kfac")
        ks.append(next(b for b in c.blocks if isinstance(b, gm.KFAC)))
    rows = []
    for rel in DELTAS if tasks == 2 else (1e-6, 1e-2):
        for name in ks[0].terms:
            terms = [k.terms[name][0] for k in ks]
            row = compare(terms, rel, seed=2)
            a, g = terms[0]
            rows.append(
                {
                    "workload": f"gpt2 {tasks} tasks",
                    "layer": name,
                    "shape": [g.shape[0], a.shape[0]],
                    "delta": rel,
                    **row,
                }
            )
            print(_fmt(rows[-1]), flush=True)
    return rows


def _fmt(row: dict) -> str:
    cells = []
    for key in ("before", "pi", "anchor", "after"):
        if key in row:
            r = row[key]
            its = "n/c" if r["iterations"] is None else r["iterations"]
            cells.append(f"{key} {its:>5} it {1e3 * r['seconds']:8.1f} ms")
    where = row.get("layer", "")[12:] or str(tuple(row["shape"]))
    return f"{row['workload']:20s} {where:18s} δ={row['delta']:.0e} | " + " | ".join(cells)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULT, help="JSON path (default: %(default)s)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    run = Run("kfac_solve", settings=vars(args) | {"tol": 1e-10, "maxiter": MAXITER}, argv=argv)
    rows = random_workload() + gpt2_workload(2) + gpt2_workload(3)
    write_result(args.out, run.finish({"rows": rows}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
