r"""A scale model: time and memory of curvature estimation and merging vs. parameters, tokens,
tasks and ranks, fitted on sizes measured here, with predictions for 7B and 70B models.

Measured (GPT-2 configs with random weights, vocabulary ``VOCAB``, several widths/depths):

- estimation, ``gm.estimate_curvature(structure="diag"|"kfac", fisher="empirical")``, one
  process: wall time and peak anonymous memory (RssAnon above the level with the model built);
- streaming merges, ``gradmerge.jobs.run_merge`` (gradient matching, Eq. 6, with T = 2–4
  diagonal curvature files; T = 2 K-FAC files; task arithmetic): wall time, bytes read/written,
  peak RssAnon (the inputs are memory-mapped: RssAnon is the merge's own footprint);
- ``torch.linalg.eigh`` of d×d float32 matrices (the K-FAC solve's per-factor cost);
- K-FAC layers at full size (``KFAC_SHAPES``: GPT-2-124M's and Llama-7B's Linear shapes up to
  11008×4096, float32, 2 tasks, both cores): each part of a merge's layer solve, and whole solves
  up to 4096×4096 that check the per-layer cost model (``kfac_layer_model``) the 7B/70B K-FAC
  merge predictions use, for stated CG-iteration counts (``KFAC_SCENARIOS``);
- ranks 1 and 2 under ``torchrun`` with gloo: distributed estimation and distributed merging, and
  an all-reduce of the curvature's size.

The model (symbols → JSON keys; P parameters, N tokens, n examples, T tasks, R ranks):

    estimation time   t_est ≈ a_s·P·N + b_s·P·n                       (per structure s)
    estimation memory m_est ≈ curvature bytes + c_h·N_b·L·h·4 + c_v·N_b·V·4   (N_b tokens per batch)
    merge time        t_merge ≈ bytes moved / B  (+ Σ_layers kfac_layer_model for K-FAC)
                      bytes moved = read (T+1 models + T curvatures) + written (1 model)
    merge memory      m_merge ≈ u·(2T + 2)·(largest unit's bytes)     (a few tensors at a time)
    ranks             t(R) ≈ t(1)/(R·e_R) + 2(R−1)/R · curvature bytes / B_allreduce

a_s, b_s, c_h, c_v, B, k, u, e_R are fitted on the smaller sizes; the largest sizes are held out,
and the relative residuals there are the fit's quality. Every measurement records
``os.getloadavg()``: this machine has 2 cores shared with other jobs, so timings are noisy and the
fitted speeds are lower bounds of the machine's.

Predictions for Llama-style 7B and 70B shapes on this CPU, and for a GPU as a labelled
extrapolation from stated assumptions (no GPU was measured), next to the anchors: mergekit's
task arithmetic on GPT-2-124M (measured here with ``--mergekit``) and the paper's script, which
holds every model and Fisher in memory: m ≈ (1 + 2T)·model bytes.

    python -m benchmarks.scale              # a few minutes; writes benchmarks/results/scale-cpu.json
    python -m benchmarks.scale --quick      # smoke run (seconds), writes nothing unless --out
    python -m benchmarks.scale --mergekit   # also time mergekit vs gradmerge on GPT-2-124M
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

import gradmerge as gm
from benchmarks.record import (
    RESULTS,
    ROOT,
    Run,
    command,
    module_argv,
    read_result,
    write_result,
)

RESULT = RESULTS / "scale-cpu.json"
VOCAB = 2048
SEQ = 64
GB = 1e9


# ----- measurement ----------------------------------------------------------------------------
def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class Measure:
    """Wall time, CPU time, load average and peak RssAnon above the start, while the block runs."""

    def __enter__(self) -> Measure:
        gc.collect()
        self.base, self.peak = _rss_anon(), 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        self.cpu, self.t0 = time.process_time(), time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, _rss_anon() - self.base)
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.cpu_seconds = time.process_time() - self.cpu
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, _rss_anon() - self.base)
        self.load = round(os.getloadavg()[0], 2)

    def row(self) -> dict[str, float]:
        return {
            "seconds": round(self.seconds, 4),
            "cpu_seconds": round(self.cpu_seconds, 4),
            "peak_anon_bytes": int(self.peak),
            "load_average": self.load,
        }


def best_of(repeats: int, fn: Callable[[Measure], None]) -> dict[str, float]:
    """The fastest of ``repeats`` runs (least disturbed by other jobs), its peak memory."""
    rows = []
    for _ in range(repeats):
        with Measure() as m:
            fn(m)
        rows.append(m.row())
    best = min(rows, key=lambda r: r["seconds"])
    return {**best, "repeats": repeats, "all_seconds": [r["seconds"] for r in rows]}


# ----- models ---------------------------------------------------------------------------------
def gpt2(width: int, depth: int, seed: int = 0) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=width,
        n_layer=depth,
        n_head=max(1, width // 64),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).eval()


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The distinct parameters (the tied lm_head is wte), as a flat state dict."""
    return {k: v.detach().clone().contiguous() for k, v in model.named_parameters()}


def batches(examples: int, batch: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (examples, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    return [
        {"input_ids": ids[i : i + batch], "labels": labels[i : i + batch]}
        for i in range(0, examples, batch)
    ]


def curvature_bytes(c: gm.Curvature) -> int:
    path = Path(tempfile.mkstemp(suffix=".safetensors")[1])
    try:
        c.save(path)
        return path.stat().st_size
    finally:
        path.unlink()


@contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():  # K-FAC leaves wpe to its diagonal block, with a warning
        warnings.simplefilter("ignore", UserWarning)
        yield


# ----- 1. estimation --------------------------------------------------------------------------
def measure_estimation(width: int, depth: int, examples: int, structure: str, rep: int) -> dict:
    model = gpt2(width, depth)
    data = batches(examples, batch=8)
    out: dict[str, Any] = {}

    def run(m: Measure) -> None:
        with quiet():
            out["c"] = gm.estimate_curvature(model, data, structure=structure, fisher="empirical")

    row = best_of(rep, run)
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "structure": structure,
        "width": width,
        "depth": depth,
        "params": n_params,
        "examples": examples,
        "tokens": examples * SEQ,
        "batch_tokens": 8 * SEQ,
        "curvature_bytes": curvature_bytes(out["c"]),
        **row,
    }


# ----- 2. streaming merges --------------------------------------------------------------------
def write_inputs(root: Path, width: int, depth: int, tasks: int, structure: str) -> dict:
    """Base, T fine-tunes (base + noise) and T curvature files (one estimate, copied T times)."""
    root.mkdir(parents=True, exist_ok=True)
    base = gpt2(width, depth)
    save_file(params(base), root / "base.safetensors")
    with quiet():
        c = gm.estimate_curvature(base, batches(2, 2), structure=structure, fisher="empirical")
    c.save(root / "c0.safetensors")
    models = []
    for t in range(tasks):
        ft = copy.deepcopy(base)
        g = torch.Generator().manual_seed(10 + t)
        with torch.no_grad():
            for p in ft.parameters():
                p.add_(1e-2 * torch.randn(p.shape, generator=g))
        save_file(params(ft), root / f"ft{t}.safetensors")
        if t:
            shutil.copyfile(root / "c0.safetensors", root / f"c{t}.safetensors")
        models.append({"model": f"ft{t}.safetensors", "curvature": f"c{t}.safetensors"})
    linears = [
        (mod.weight.shape[0], mod.weight.shape[1])
        for mod in base.modules()
        if type(mod).__name__ == "Conv1D"
    ]
    return {
        "models": models,
        "params": sum(p.numel() for p in base.parameters()),
        "kron_mv_flops": sum(2 * a * b * (a + b) for a, b in linears),
    }


def measure_merge(
    root: Path, inputs: dict, method: str, structure: str, tasks: int, rep: int
) -> dict:
    from gradmerge.jobs import MergeConfig

    spec: dict[str, Any] = {
        "method": method,
        "base_model": "base.safetensors",
        "models": [
            m if method != "task_arithmetic" else {"model": m["model"]}
            for m in inputs["models"][:tasks]
        ],
    }
    if method == "gradient_matching":
        spec["prior"] = {"delta": 1e-3}
    config = MergeConfig.from_dict(spec, root=root)
    (root / "merge.json").write_text(json.dumps(spec))
    runs = []
    for _ in range(rep):  # a fresh process each time: its heap starts empty (honest RssAnon)
        done = subprocess.run(
            module_argv("scale", "_merge", str(root)),
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=600,
        )
        if done.returncode != 0:
            raise RuntimeError(f"merge in {root} failed:\n{done.stderr[-3000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    row = min(runs, key=lambda r: r["seconds"])
    row = {**row, "repeats": rep, "all_seconds": [r["seconds"] for r in runs]}
    from gradmerge.jobs import plan_merge

    plan = plan_merge(config)
    largest = sum(
        int(np.prod(plan.shapes[k])) * plan.out_dtypes[k].itemsize for k in plan.largest_unit.keys
    )
    shutil.rmtree(root / "out", ignore_errors=True)
    return {
        "method": method,
        "structure": structure if method != "task_arithmetic" else None,
        "tasks": tasks,
        "params": inputs["params"],
        "kron_mv_flops": inputs["kron_mv_flops"] if structure == "kfac" else 0,
        "bytes_moved": row["bytes_read"] + row["bytes_written"],
        "largest_unit_bytes": largest,
        "cg_iterations": cg_iterations(config, plan) if structure == "kfac" else None,
        **row,
    }


def merge_child(root: Path) -> None:
    """In a fresh process: run the merge of ``root/merge.json``; print time, memory, bytes."""
    from gradmerge.jobs import MergeConfig, run_merge

    torch.set_num_threads(1)
    config = MergeConfig.from_dict(json.loads((root / "merge.json").read_text()), root=root)
    with Measure() as m:
        r = run_merge(config, root / "out", overwrite=True, progress=False)
    print(json.dumps({**m.row(), "bytes_read": r.bytes_read, "bytes_written": r.bytes_written}))


def cg_iterations(config: Any, plan: Any) -> dict[str, int]:
    """CG iterations per K-FAC layer of the merge's solve (H̄ = δ·I + Σ_t α_t A_t ⊗ G_t)."""
    from contextlib import ExitStack

    from gradmerge.curvature import KFAC
    from gradmerge.jobs.engine import open_job

    seen: dict[str, int] = {}
    original = KFAC.solve_info

    def spy(self: KFAC, v: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, v, *args, **kwargs)
        seen.update({name: part.iterations for name, part in out.parts.items()})
        return out

    KFAC.solve_info = spy  # type: ignore[method-assign]
    try:
        with ExitStack() as stack:
            job = open_job(config, stack)
            for unit in plan.units[:8]:  # the first units: enough to see the counts
                if unit.merged:
                    job.compute_unit(unit)
    finally:
        KFAC.solve_info = original  # type: ignore[method-assign]
    return seen


# ----- 3. eigendecompositions -----------------------------------------------------------------
def measure_eigh(d: int, rep: int) -> dict:
    g = torch.Generator().manual_seed(d)
    x = torch.randn(d, d, generator=g)
    a = x @ x.T / d + torch.eye(d)
    return {"d": d, **best_of(rep, lambda m: torch.linalg.eigh(a))}


# ----- 3b. K-FAC layer solves at full size -----------------------------------------------------
KFAC_SHAPES = [(768, 768), (3072, 768), (4096, 4096), (11008, 4096)]
"""(out, in) of the layers measured: GPT-2-124M's attention and MLP, Llama-7B's attention and
MLP (gate/up; the down projection is its transpose: the same cost)."""


def _factor(d: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    """A K-FAC-like factor: the mean Gram of ``rows`` random features whose scales decay over
    three orders of magnitude (float32)."""
    scales = 10.0 ** (-1.5 * torch.linspace(0, 1, d))
    x = torch.randn(rows, d, generator=gen) * scales
    return x.T @ x / rows


def measure_kfac_layer(out_dim: int, in_dim: int, tasks: int, rel: float | None, rep: int) -> dict:
    """One K-FAC layer of T tasks in float32: the cost of each part of its merge solve
    (:mod:`gradmerge.solvers.kfac_cg`) and, when ``rel`` is given, the whole solve of
    (δ·I + Σ_t A_t ⊗ G_t) X = B at δ = rel·max_t ‖A_t‖₂‖G_t‖₂ (tolerance 1e-5, certified in
    float64), whose CG iterations and refinements the model uses."""
    from gradmerge.solvers import kfac_cg

    gen = torch.Generator().manual_seed(out_dim + in_dim)
    rows = 2 * max(out_dim, in_dim)
    terms = [(_factor(in_dim, rows, gen), _factor(out_dim, rows, gen)) for _ in range(tasks)]
    b = torch.randn(out_dim, in_dim, generator=gen)
    row: dict[str, Any] = {"out": out_dim, "in": in_dim, "tasks": tasks}
    kfac_flops = 2 * out_dim * in_dim * (out_dim + in_dim)
    row["kron_mv_flops"] = kfac_flops
    a, g = terms[0]
    row["eigh_in_seconds"] = best_of(rep, lambda m: torch.linalg.eigh(a))["seconds"]
    row["eigh_out_seconds"] = best_of(rep, lambda m: torch.linalg.eigh(g))["seconds"]
    row["kron_mv32_seconds"] = best_of(rep, lambda m: g @ b @ a)["seconds"]
    row["residual_term64_seconds"] = best_of(rep, lambda m: kfac_cg.residual(0.0, [(a, g)], b, b))[
        "seconds"
    ]
    row["psd_check_seconds"] = best_of(rep, lambda m: gm.KFAC({"l": (a, g)}).check_psd(name="l"))[
        "seconds"
    ]
    if rel is not None:
        scale = max(
            float(torch.linalg.matrix_norm(a.double(), 2) * torch.linalg.matrix_norm(g.double(), 2))
            for a, g in terms
        )
        with Measure() as m:
            solve = kfac_cg.solve("l", rel * scale, terms, b)
        row |= {
            "delta_relative": rel,
            "solve_seconds": m.row()["seconds"],
            "cg_iterations": solve.iterations,
            "residual": solve.residual,
            "method": solve.method,
        }
    print("kfac layer", json.dumps(row), flush=True)
    return row


def kfac_layer_model(row: dict, rates: dict, iterations: int, refinements: int) -> float:
    """Predicted seconds of one layer's solve: the two eigendecompositions of the collapsed
    factors, T rotations of each factor (two GEMMs each), T Kronecker products per CG iteration
    (+1 for the start), the float64 residual per certification, and the PSD checks."""
    d3 = row["out"] ** 3 + row["in"] ** 3
    t = rates["eigh_seconds_per_d3"] * d3
    t += row["tasks"] * 4 * d3 / rates["gemm32_flops_per_second"]
    t += (
        (iterations + 1 + refinements)
        * row["tasks"]
        * row["kron_mv_flops"]
        / rates["gemm32_flops_per_second"]
    )
    t += (1 + refinements) * row["tasks"] * row["kron_mv_flops"] / rates["gemm64_flops_per_second"]
    t += row["tasks"] * rates["psd_seconds_per_d3"] * d3
    return t


def kfac_rates(rows: list[dict]) -> dict:
    """Flop rates and eigh/PSD constants from the component timings of the largest shapes."""
    big = [r for r in rows if r["out"] * r["in"] >= 4096 * 4096]
    big = big or rows
    d3 = [r["out"] ** 3 + r["in"] ** 3 for r in big]
    return {
        "gemm32_flops_per_second": float(
            np.median([r["kron_mv_flops"] / r["kron_mv32_seconds"] for r in big])
        ),
        "gemm64_flops_per_second": float(
            np.median([r["kron_mv_flops"] / r["residual_term64_seconds"] for r in big])
        ),
        "eigh_seconds_per_d3": float(
            np.median(
                [
                    (r["eigh_in_seconds"] + r["eigh_out_seconds"]) / x
                    for r, x in zip(big, d3, strict=True)
                ]
            )
        ),
        "psd_seconds_per_d3": float(
            np.median([r["psd_check_seconds"] / x for r, x in zip(big, d3, strict=True)])
        ),
    }


def kfac_fit(rows: list[dict]) -> dict:
    """The layer model's rates, checked against every measured whole solve."""
    rates = kfac_rates(rows)
    checks = []
    for r in rows:
        if "solve_seconds" in r:
            found = re.search(r"(\d+) refinement", r["method"])
            refinements = int(found.group(1)) if found else 0
            predicted = kfac_layer_model(r, rates, r["cg_iterations"], refinements)
            checks.append(
                {
                    "shape": [r["out"], r["in"]],
                    "cg_iterations": r["cg_iterations"],
                    "measured_seconds": r["solve_seconds"],
                    "predicted_seconds": predicted,
                    "relative_residual": round(predicted / r["solve_seconds"] - 1, 3),
                }
            )
    return {
        "model": "per layer: eigh of the two collapsed factors + T·4·(d_in³ + d_out³) flops of "
        "rotations + (iterations + 1 + refinements)·T Kronecker products in float32 + "
        "(1 + refinements)·T in float64 (certification) + T PSD checks; rates from the "
        "4096-and-larger shapes",
        "rates": rates,
        "checks_against_whole_solves": checks,
    }


# ----- 4. ranks (torchrun, gloo) --------------------------------------------------------------
def rank_worker(argv: list[str]) -> None:
    """One rank: estimation on its shard, an all-reduce of the curvature's size, a merge."""
    import torch.distributed as dist

    import gradmerge.distributed as gmd
    from gradmerge.distributed.merge import run_merge
    from gradmerge.jobs import MergeConfig

    width, depth, examples, workdir = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, data = gpt2(width, depth), batches(examples, 8)
    out: dict[str, Any] = {"rank": rank, "world": world}
    for structure in ("diag", "kfac"):
        dist.barrier()
        t0 = time.perf_counter()
        with quiet():
            c = gmd.estimate_curvature(model, gmd.shard(data), structure=structure, timeout=300)
        out[f"estimate_{structure}_seconds"] = time.perf_counter() - t0
        out[f"curvature_{structure}_bytes"] = curvature_bytes(c) if rank == 0 else None
    n = sum(p.numel() for p in model.parameters())
    buf = torch.ones(n)
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(buf)
    out["allreduce_seconds"], out["allreduce_bytes"] = time.perf_counter() - t0, 4 * n
    config = MergeConfig.from_dict(
        {
            "method": "gradient_matching",
            "base_model": "base.safetensors",
            "models": json.loads((workdir / "models.json").read_text()),
            "prior": {"delta": 1e-3},
        },
        root=workdir,
    )
    dist.barrier()
    t0 = time.perf_counter()
    report = run_merge(config, workdir / f"out{world}", overwrite=True, timeout=300)
    out["merge_seconds"] = time.perf_counter() - t0
    out["merge_bytes_moved"] = report.bytes_read + report.bytes_written
    out["load_average"] = round(os.getloadavg()[0], 2)
    (workdir / f"ranks{world}-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def measure_ranks(workdir: Path, width: int, depth: int, examples: int, tasks: int) -> list:
    inputs = write_inputs(workdir, width, depth, tasks, "diag")
    (workdir / "models.json").write_text(json.dumps(inputs["models"]))
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    rows = []
    for world in (1, 2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [torchrun, f"--nproc-per-node={world}", f"--master-port={port}", "-m"]
        cmd += ["benchmarks.scale", "_rank", str(width), str(depth), str(examples)]
        t0 = time.perf_counter()
        done = subprocess.run(
            [*cmd, str(workdir)],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            raise RuntimeError(f"torchrun with {world} ranks failed:\n{done.stderr[-3000:]}")
        per_rank = [
            json.loads((workdir / f"ranks{world}-{r}.json").read_text()) for r in range(world)
        ]
        row = {"ranks": world, "params": inputs["params"], "tokens": examples * SEQ}
        row["wall_seconds_with_startup"] = round(time.perf_counter() - t0, 2)
        for key in ("estimate_diag_seconds", "estimate_kfac_seconds", "merge_seconds"):
            row[key] = round(max(p[key] for p in per_rank), 4)  # the slowest rank
        row["allreduce_seconds"] = round(max(p["allreduce_seconds"] for p in per_rank), 4)
        row["allreduce_bytes"] = per_rank[0]["allreduce_bytes"]
        row["curvature_kfac_bytes"] = per_rank[0]["curvature_kfac_bytes"]
        row["merge_bytes_moved"] = sum(p["merge_bytes_moved"] for p in per_rank)
        row["load_average"] = max(p["load_average"] for p in per_rank)
        rows.append(row)
    return rows


# ----- 5. mergekit anchor ---------------------------------------------------------------------
def measure_mergekit(workdir: Path) -> dict:
    """mergekit-yaml vs gradmerge merge (task arithmetic, 2 fine-tunes) on GPT-2-124M shapes."""
    import transformers
    import yaml

    base = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    base.save_pretrained(workdir / "base")
    for t in range(2):
        ft = copy.deepcopy(base)
        with torch.no_grad():
            for p in ft.parameters():
                p.add_(1e-2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(t)))
        ft.save_pretrained(workdir / f"ft{t}")
    del base, ft
    models = [{"model": str(workdir / f"ft{t}"), "parameters": {"weight": 0.5}} for t in range(2)]
    mk = {"merge_method": "task_arithmetic", "base_model": str(workdir / "base")}
    (workdir / "mk.yaml").write_text(yaml.safe_dump({**mk, "models": models, "dtype": "float32"}))
    ours = {
        "method": "task_arithmetic",
        "base_model": str(workdir / "base"),
        "models": [{"model": m["model"], "alpha": 0.5} for m in models],
    }
    (workdir / "gm.yaml").write_text(yaml.safe_dump(ours))
    bindir = Path(sys.executable).parent
    runs = {
        "mergekit": [str(bindir / "mergekit-yaml"), "mk.yaml", "out-mk", "--allow-crimes"],
        "gradmerge": [str(bindir / "gradmerge"), "merge", "gm.yaml", "out-gm"],
    }
    out = {"params": 124_439_808}
    for name, cmd in runs.items():
        timed = ["/usr/bin/time", "-f", "%e %M"] if Path("/usr/bin/time").exists() else []
        t0 = time.perf_counter()
        done = subprocess.run([*timed, *cmd], cwd=workdir, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        row: dict[str, Any] = {"wall_seconds": round(wall, 2), "returncode": done.returncode}
        if timed and done.returncode == 0:
            row["peak_rss_bytes"] = int(done.stderr.strip().splitlines()[-1].split()[1]) * 1024
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", _IMPORT[name]], capture_output=True)
        row["import_seconds"] = round(time.perf_counter() - t0, 2)
        row["load_average"] = round(os.getloadavg()[0], 2)
        out[name] = row
    return out


_IMPORT = {
    "mergekit": "import mergekit.merge, mergekit.config",
    "gradmerge": "import gradmerge.cli, gradmerge.jobs",
}


# ----- fits -----------------------------------------------------------------------------------
def nnls(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (relative error weighted), by active set."""
    w = 1.0 / target
    active = list(range(features.shape[1]))
    while True:
        coef = np.zeros(features.shape[1])
        sol, *_ = np.linalg.lstsq(features[:, active] * w[:, None], target * w, rcond=None)
        coef[active] = sol
        if (coef >= 0).all() or len(active) == 1:
            return np.maximum(coef, 0)
        active.remove(active[int(np.argmin(sol))])


def fit(
    rows: list[dict], features: Callable[[dict], list[float]], target: str, held: Callable
) -> dict:
    train = [r for r in rows if not held(r)]
    test = [r for r in rows if held(r)]
    if not train:  # a single size (--quick): fit on it, nothing held out
        train, test = test, []
    X = np.array([features(r) for r in train], dtype=float)
    y = np.array([r[target] for r in train], dtype=float)
    coef = nnls(X, y)

    def rel(rs: list[dict]) -> list[float]:
        return [
            round(float(np.dot(coef, features(r)) / r[target] - 1), 3) for r in rs if r[target] > 0
        ]

    return {
        "coefficients": [float(c) for c in coef],
        "train_relative_residuals": rel(train),
        "held_out_relative_residuals": rel(test),
        "held_out_max_abs": max((abs(x) for x in rel(test)), default=None),
    }


# ----- predictions ----------------------------------------------------------------------------
LLAMA = {
    "llama-7b": {"hidden": 4096, "layers": 32, "mlp": 11008, "vocab": 32000, "kv": 4096},
    "llama-70b": {"hidden": 8192, "layers": 80, "mlp": 28672, "vocab": 32000, "kv": 1024},
}


def llama_shapes(s: dict) -> dict:
    h, m, kv, v, n = s["hidden"], s["mlp"], s["kv"], s["vocab"], s["layers"]
    linears = [(h, h), (kv, h), (kv, h), (h, h), (m, h), (m, h), (h, m)]  # (out, in)
    per_layer = sum(a * b for a, b in linears) + 2 * h
    p = n * per_layer + 2 * v * h + h
    kfac_floats = (
        n * sum(a * a + b * b for a, b in linears) + v * v + h * h + v * h + (2 * n + 1) * h
    )
    kron = n * sum(2 * a * b * (a + b) for a, b in linears) + 2 * v * h * (v + h)  # lm_head too
    sum_d3 = n * sum(a**3 + b**3 for a, b in linears) + v**3 + h**3
    largest_unit = max(v * h, m * h)  # embedding/lm_head or an MLP matrix (diagonal: one tensor)
    limit = 16384  # kfac_max_factor_side: larger layers (vocabulary heads, 70B's MLP) are diagonal
    kfac_layers = [(a, b) for a, b in linears if max(a, b) <= limit] * n
    return {
        "params": p,
        "layers": n,
        "hidden": h,
        "vocab": v,
        "kfac_curvature_bytes": 4 * kfac_floats,
        "sum_d3": sum_d3,
        "kron_mv_flops": kron,
        "largest_unit_floats": largest_unit,
        "kfac_layers": kfac_layers,
    }


def predict(fits: dict, ranks: list[dict]) -> dict:
    tokens, batch_tokens, tasks = 1_000_000, 8 * 2048, 4
    out: dict[str, Any] = {
        "assumptions": {
            "tokens_per_task": tokens,
            "examples_per_task": tokens // 2048,
            "sequence_length": 2048,
            "tokens_per_batch": batch_tokens,
            "tasks": tasks,
            "dtype": "float32 models and curvatures (bfloat16 halves every byte count)",
            "kfac": "every Linear incl. lm_head as Kronecker factors; norms diagonal",
        }
    }
    a = {s: fits[f"estimate_time_{s}"]["coefficients"] for s in ("diag", "kfac")}
    mem = fits["estimate_memory"]["coefficients"]
    bw = 1 / fits["merge_time_diag"]["coefficients"][0]
    u = fits["merge_memory"]["coefficients"][0]
    for name, spec in LLAMA.items():
        s = llama_shapes(spec)
        p, n_ex = s["params"], tokens // 2048
        model_bytes = 4 * p
        row: dict[str, Any] = {"params": p, "model_bytes_fp32": model_bytes}
        for st in ("diag", "kfac"):
            curv = model_bytes if st == "diag" else s["kfac_curvature_bytes"]
            t = a[st][0] * p * tokens + a[st][1] * p * n_ex
            act = mem[1] * batch_tokens * s["layers"] * s["hidden"] * 4
            act += mem[2] * batch_tokens * s["vocab"] * 4
            row[f"estimate_{st}"] = {
                "cpu_seconds_one_process": t,
                "cpu_hours_one_process": t / 3600,
                "memory_bytes": model_bytes + mem[0] * curv + act,
                "curvature_bytes": curv,
            }
        moved = (tasks + 1) * model_bytes + tasks * model_bytes + model_bytes
        row["merge_diag"] = {
            "bytes_moved": moved,
            "cpu_seconds": moved / bw,
            "memory_bytes": u * (2 * tasks + 2) * 4 * s["largest_unit_floats"],
        }
        kf_moved = 3 * model_bytes + 2 * s["kfac_curvature_bytes"]
        rates = fits["kfac_layer"]["rates"]
        gpu_rates = rates | {
            "gemm32_flops_per_second": GPU_ASSUMPTIONS["gemm_fp32_flops_per_s"],
            "gemm64_flops_per_second": GPU_ASSUMPTIONS["gemm_fp64_flops_per_s"],
            "eigh_seconds_per_d3": 9 / GPU_ASSUMPTIONS["eigh_fp32_flops_per_s"],
            "psd_seconds_per_d3": (1 / 3) / GPU_ASSUMPTIONS["gemm_fp64_flops_per_s"],
        }
        layers = [
            {"out": o, "in": i, "tasks": 2, "kron_mv_flops": 2 * o * i * (o + i)}
            for o, i in s["kfac_layers"]
        ]
        row["merge_kfac_T2"] = {
            "bytes_moved": kf_moved,
            "kfac_layers": len(layers),
            "note": "CG-bound: the CG iterations per layer depend on δ relative to the "
            "curvature's scale; the counts are those measured on GPT-2-124M's real factors "
            "(results/gpt2-kfac-layers-cpu.json: 23 / 70 at δ = 1e-2 / 1e-4 of the layer's "
            "scale, bfloat16 products under float32 refinement; 176 at 1e-6 needed float64 and "
            "costs about twice as much per iteration, not modelled); layers with a factor side "
            "above 16384 (kfac_max_factor_side) are diagonal",
        }
        for label, its, refinements in KFAC_SCENARIOS:
            cpu = sum(kfac_layer_model(r, rates, its, refinements) for r in layers)
            gpu = sum(kfac_layer_model(r, gpu_rates, its, refinements) for r in layers)
            row["merge_kfac_T2"][label] = {
                "cpu_seconds_2_cores": kf_moved / bw + cpu,
                "gpu_extrapolation_seconds": kf_moved / GPU_ASSUMPTIONS["disk_bytes_per_s"] + gpu,
            }
        row["paper_script_memory_bytes"] = (1 + 2 * tasks) * model_bytes
        # GPU: a labelled extrapolation (nothing measured on a GPU in this run)
        gpu = GPU_ASSUMPTIONS
        fb = 6 * p * tokens / (gpu["peak_bf16_flops"] * gpu["mfu"])
        row["gpu_extrapolation"] = {
            f"estimate_{st}_seconds_one_gpu": fb * gpu["ratio_to_forward_backward"][st]
            for st in ("diag", "kfac")
        }
        row["gpu_extrapolation"]["merge_diag_seconds_disk_bound"] = moved / gpu["disk_bytes_per_s"]
        out[name] = row
    two = [r for r in ranks if r["ranks"] == 2]
    if two and ranks:
        one = next(r for r in ranks if r["ranks"] == 1)
        out["rank_speedup_measured"] = {
            k: round(one[k] / two[0][k], 2)
            for k in ("estimate_diag_seconds", "estimate_kfac_seconds", "merge_seconds")
        }
    return out


GPU_ASSUMPTIONS = {
    "label": "EXTRAPOLATION, not measured: no GPU was lent to this run",
    "device": "one NVIDIA H100 SXM",
    "peak_bf16_flops": 989e12,
    "mfu": 0.4,
    "ratio_to_forward_backward": {"diag": 1.3, "kfac": 1.6},
    "ratio_source": "benchmarks/results/curvature-cpu.json (CPU ratios, assumed to carry over)",
    "disk_bytes_per_s": 2e9,
    "eigh_fp32_flops_per_s": 1e12,
    "gemm_fp32_flops_per_s": 30e12,
    "gemm_fp64_flops_per_s": 30e12,
    "gemm_note": "half of the H100 SXM's 60-67 TFLOP/s fp32 / fp64 (no TF32)",
}

GPT2_124M_KFAC = [(2304, 769), (768, 769), (3072, 769), (768, 3073)] * 12
"""GPT-2-124M's K-FAC layers (out, in + bias) as ``gradmerge merge`` solves them."""


def calibrate(report: dict, measured: dict, source: str) -> dict:
    """The per-layer K-FAC model (:func:`kfac_layer_model`, rates of ``report``'s fits) against
    the end-to-end GPT-2-124M 2-task merges of ``benchmarks.kfac_tolerance`` (``measured``: its
    record's results):
    a fixed-cost factor (the ``approximate maxiter=0`` merge against the model at 0 iterations)
    and a per-iteration factor for float32 and for bfloat16 products (wall above the fixed cost
    over the model's per-iteration cost); then the Llama 7B/70B 2-task K-FAC merge predictions
    with those factors, at GPT-2-124M's measured iterations per layer at tol 1e-5."""
    rates = report["fits"]["kfac_layer"]["rates"]
    bw = 1 / report["fits"]["merge_time_diag"]["coefficients"][0]

    def parts(shapes: list[tuple[int, int]]) -> tuple[float, float]:
        layers = [
            {"out": o, "in": i, "tasks": 2, "kron_mv_flops": 2 * o * i * (o + i)} for o, i in shapes
        ]
        fixed = sum(kfac_layer_model(r, rates, 0, 0) for r in layers)
        per_iteration = sum(kfac_layer_model(r, rates, 1, 0) for r in layers) - fixed
        return fixed, per_iteration / len(layers)  # per layer-iteration

    rows = {r["setting"]: r for r in measured["rows"] if r.get("returncode") == 0}
    fixed_model, iteration_model = parts(GPT2_124M_KFAC)
    gpt2_bytes = 4 * 124_439_808  # the saved model (tied head)
    io = (3 * gpt2_bytes + 2 * 4 * sum(o * o + i * i for o, i in GPT2_124M_KFAC)) / bw
    fixed = rows["approximate maxiter=0"]["wall_seconds"]
    fixed_factor = fixed / (fixed_model + io)
    out: dict[str, Any] = {
        "source": source,
        "gpt2_124m_model_fixed_seconds": fixed_model + io,
        "gpt2_124m_measured_fixed_seconds": fixed,
        "fixed_factor": fixed_factor,
    }
    factors = {}
    for label, key in (
        ("float32", "tol=1e-05, float32 products"),
        ("bfloat16", "tol=1e-05, bfloat16 products"),
    ):
        if key not in rows:  # a record without that row: no prediction for its arithmetic
            continue
        r = rows[key]
        per = (r["wall_seconds"] - fixed) / r["cg_iterations"]
        factors[label] = {
            "iterations_per_layer": r["cg_iterations"] / len(GPT2_124M_KFAC),
            "measured_seconds_per_layer_iteration": per,
            "model_seconds_per_layer_iteration": iteration_model,
            "factor": per / iteration_model,
        }
    out["per_iteration"] = factors
    for name, spec in LLAMA.items():
        shapes = llama_shapes(spec)
        fixed_7b, per_7b = parts(shapes["kfac_layers"])
        n = len(shapes["kfac_layers"])
        moved = (3 * 4 * shapes["params"] + 2 * shapes["kfac_curvature_bytes"]) / bw
        out[name] = {
            label: {
                "cpu_seconds_2_cores": (fixed_7b + moved) * fixed_factor
                + f["iterations_per_layer"] * n * per_7b * f["factor"],
                "cpu_hours_2_cores": (
                    (fixed_7b + moved) * fixed_factor
                    + f["iterations_per_layer"] * n * per_7b * f["factor"]
                )
                / 3600,
            }
            for label, f in factors.items()
        }
    return out


KFAC_SCENARIOS = [  # (label, CG iterations per layer, refinements)
    ("approximate_maxiter_0", 0, 0),
    ("delta_1e-2_of_scale_23_iterations", 23, 0),
    ("delta_1e-4_of_scale_70_iterations", 70, 1),
]


# ----- driver ---------------------------------------------------------------------------------
def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        rank_worker(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_merge":
        merge_child(Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, no ranks")
    parser.add_argument("--mergekit", action="store_true", help="time mergekit on GPT-2-124M")
    parser.add_argument("--no-ranks", action="store_true", help="skip the torchrun measurements")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON to write ({RESULT})")
    parser.add_argument(
        "--calibrate",
        type=Path,
        metavar="TOLERANCE_JSON",
        help="no measurement: refit the K-FAC merge predictions of the existing results to the "
        "end-to-end GPT-2-124M merges of kfac_tolerance.py's JSON, and add them to the results",
    )
    args = parser.parse_args()
    if args.calibrate:  # no measurement: added to the measuring run's record, with its command
        path = args.out or RESULT
        record = read_result(path)
        measured = read_result(args.calibrate)["results"]
        calibration = calibrate(record["results"], measured, str(args.calibrate))
        record["results"]["kfac_calibration"] = {"command": command("scale"), **calibration}
        write_result(path, record)
        print(json.dumps(record["results"]["kfac_calibration"], indent=1))
        return
    out = args.out or (None if args.quick else RESULT)
    torch.set_num_threads(1)  # 2 threads on 2 shared cores: OpenMP spin-waits, 5× slower
    rep = 1 if args.quick else 2
    run = Run("scale", settings=vars(args))
    report: dict[str, Any] = {}

    # 1. estimation: widths × depths × tokens; the largest width is held out
    sizes = (
        [(32, 1, 8), (32, 2, 16), (48, 1, 8)]
        if args.quick
        else [
            (64, 2, 16),
            (64, 4, 16),
            (128, 2, 16),
            (128, 2, 32),
            (128, 4, 16),
            (192, 2, 16),
            (256, 4, 16),
        ]
    )  # fmt: skip  (the largest width is held out)
    est = []
    for width, depth, examples in sizes:
        for structure in ("diag", "kfac"):
            est.append(measure_estimation(width, depth, examples, structure, 1))
            print("estimate", est[-1]["structure"], width, depth, examples, est[-1]["seconds"])
    report["estimation"] = est
    largest_w = max(r["width"] for r in est)

    # 2. merges: T = 2..4 diagonal, T = 2 K-FAC, task arithmetic
    merges = []
    mwidths = {
        "diag": [(32, 1)] if args.quick else [(64, 2), (128, 4), (256, 4), (384, 4)],
        "kfac": [(32, 1)] if args.quick else [(32, 1), (48, 1), (64, 1)],  # CG-bound: small
    }
    with tempfile.TemporaryDirectory(prefix="gm-scale-") as tmp:
        for structure, shapes in mwidths.items():
            for width, depth in shapes:
                root = Path(tmp) / f"{structure}-{width}-{depth}"
                tasks_max = 2 if (structure == "kfac" or args.quick) else 4
                inputs = write_inputs(root, width, depth, tasks_max, structure)
                for tasks in range(2, tasks_max + 1):
                    merges.append(
                        measure_merge(
                            root, inputs, "gradient_matching", structure, tasks,
                            rep if structure == "diag" else 1,
                        )
                    )  # fmt: skip
                    print("merge", structure, width, depth, tasks, merges[-1]["seconds"])
                if structure == "diag":
                    merges.append(measure_merge(root, inputs, "task_arithmetic", "", 2, rep))
                shutil.rmtree(root)
        for r in merges:
            r["bytes_per_second"] = round(r["bytes_moved"] / r["seconds"])
        report["merge"] = merges

        # 3. eigendecompositions
        ds = [64, 128] if args.quick else [256, 384, 512, 768, 1024]
        eig = [measure_eigh(d, rep) for d in ds]
        report["eigh"] = eig

        # 3b. K-FAC layers at full size: the parts of a solve, and whole solves (2 tasks)
        # (2 threads, as `gradmerge merge` runs: these are GEMM/eigh-bound, not spin-bound)
        shapes = KFAC_SHAPES[:1] if args.quick else KFAC_SHAPES
        torch.set_num_threads(os.cpu_count() or 1)
        report["kfac_layers_threads"] = torch.get_num_threads()
        report["kfac_layers"] = [
            measure_kfac_layer(o, i, 2, None if (o, i) == (11008, 4096) else 1e-2, 1)
            for o, i in shapes
        ]
        torch.set_num_threads(1)

        # 4. ranks
        ranks: list[dict] = []
        if not (args.quick or args.no_ranks):
            ranks = measure_ranks(Path(tmp) / "ranks", 128, 4, 32, 2)
        report["ranks"] = ranks

        # 5. mergekit
        if args.mergekit:
            report["mergekit_anchor"] = measure_mergekit(Path(tmp) / "mergekit")

    # fits (largest sizes held out)
    fits = {}
    for s in ("diag", "kfac"):
        rows = [r for r in est if r["structure"] == s]
        fits[f"estimate_time_{s}"] = {
            "model": "seconds ≈ a·params·tokens + b·params·examples + c·batches",
            **fit(rows, lambda r: [r["params"] * r["tokens"], r["params"] * r["examples"],
                                   r["examples"] / 8], "seconds", lambda r: r["width"] == largest_w),
        }  # fmt: skip
    fits["estimate_memory"] = {
        "model": "peak bytes ≈ k·curvature bytes + c_h·batch tokens·layers·width·4 + "
        "c_v·batch tokens·vocab·4",
        **fit(
            est,
            lambda r: [
                r["curvature_bytes"],
                r["batch_tokens"] * r["depth"] * r["width"] * 4,
                r["batch_tokens"] * VOCAB * 4,
            ],
            "peak_anon_bytes",
            lambda r: r["width"] == largest_w,
        ),
    }
    gm_rows = [r for r in merges if r["method"] == "gradient_matching"]
    big = {s: max(r["params"] for r in gm_rows if r["structure"] == s) for s in ("diag", "kfac")}
    fits["merge_time_diag"] = {
        "model": "seconds ≈ bytes moved / B  (coefficient: 1/B in s per byte)",
        **fit([r for r in gm_rows if r["structure"] == "diag"], lambda r: [r["bytes_moved"]],
              "seconds", lambda r: r["params"] == big["diag"]),
    }  # fmt: skip
    inv_b = fits["merge_time_diag"]["coefficients"][0]
    kf = [r for r in gm_rows if r["structure"] == "kfac"]
    for r in kf:
        r["seconds_beyond_bytes"] = r["seconds"] - r["bytes_moved"] * inv_b
    fits["merge_time_kfac"] = {
        "model": "seconds ≈ bytes moved / B (B from the diagonal fit) + k·F, "
        "F = Σ_layers 2·d_in·d_out·(d_in + d_out) (one Kronecker product): k ≈ CG iterations·T "
        "/ flop rate",
        **fit(kf, lambda r: [r["kron_mv_flops"]], "seconds_beyond_bytes",
              lambda r: r["params"] == big["kfac"]),
    }  # fmt: skip
    fits["merge_memory"] = {
        "model": "peak RssAnon ≈ u·(2T + 2)·largest unit bytes",
        **fit(gm_rows, lambda r: [(2 * r["tasks"] + 2) * r["largest_unit_bytes"]],
              "peak_anon_bytes", lambda r: r["params"] == big["diag"]),
    }  # fmt: skip
    eig_fit = fit(eig, lambda r: [r["d"] ** 3], "seconds", lambda r: r["d"] == max(ds))
    fits["eigh"] = {"model": "seconds ≈ c·d³", **eig_fit}
    if ranks:
        one, two = ranks
        fits["ranks"] = {
            "model": "t(R) ≈ t(1)/(R·e_R) + all-reduce; e_2 measured per phase",
            "efficiency_2_ranks": {
                k: round(one[k] / (2 * two[k]), 3)
                for k in ("estimate_diag_seconds", "estimate_kfac_seconds", "merge_seconds")
            },
            "allreduce_bytes_per_second": round(two["allreduce_bytes"] / two["allreduce_seconds"]),
        }
    fits["kfac_layer"] = kfac_fit(report["kfac_layers"])
    report["fits"] = fits
    report["gpu_assumptions"] = GPU_ASSUMPTIONS
    report["predictions"] = predict(fits, ranks)
    report["anchors"] = {
        "mergekit_design_md": "task_arithmetic on three GPT-2-124M checkpoints: 8–9 s wall "
        "(about 6 s start-up), 2.96 GB peak RSS (measured on the development machine, 2 CPU cores)",
        "paper_script_memory": "(1 + 2T)·model bytes: every model and Fisher held in memory",
    }
    record = run.finish(report)
    if out is not None:
        write_result(out, record)
        print(f"wrote {out} ({record['seconds']} s)")
    summary(report)


def summary(report: dict) -> None:
    for name, f in report["fits"].items():
        if "coefficients" in f:
            print(f"{name:22s} coef={[f'{c:.3e}' for c in f['coefficients']]} "
                  f"held-out={f['held_out_relative_residuals']}")  # fmt: skip
        else:
            print(name, f)
    for name in LLAMA:
        p = report["predictions"][name]
        print(name, f"{p['params'] / 1e9:.2f}B",
              f"diag est {p['estimate_diag']['cpu_hours_one_process']:.3g} h",
              f"kfac est {p['estimate_kfac']['cpu_hours_one_process']:.3g} h",
              f"merge diag T=4 {p['merge_diag']['cpu_seconds']:.0f} s "
              f"({p['merge_diag']['memory_bytes'] / GB:.2f} GB)",
              "merge kfac T=2 " + ", ".join(
                  f"{k}={v['cpu_seconds_2_cores']:.3g} s"
                  for k, v in p["merge_kfac_T2"].items() if isinstance(v, dict)),
              f"paper script {p['paper_script_memory_bytes'] / GB:.0f} GB")  # fmt: skip


if __name__ == "__main__":
    main()
