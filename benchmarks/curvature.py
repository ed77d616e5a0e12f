"""Curvature estimators: time and peak memory as ratios to one plain forward+backward pass.

Each workload (an MLP 784-512-512-10 with batch 256, and a GPT-2-style transformer built from a
config with random weights) runs every estimator on the same data, side by side with BackPACK,
curvlinops and torch.func's vmap where they apply, each interleaved with a fresh measurement of
the plain forward+backward pass over the same batches. Ratios are method / that pass (median
over repeats). Peak memory: CUDA's max_memory_allocated above the model's, or on CPU the peak
of the process's anonymous resident memory (RssAnon, sampled every millisecond) above the level
before the run. Unsupported method/model pairs are recorded with the reason. The load average of the machine is
recorded with every measurement (ratios taken on a loaded machine are noisy), and CPU-time
ratios beside the wall-clock ones.

    python -m benchmarks.curvature                      # CPU workloads, writes JSON
    python -m benchmarks.curvature --device cuda --gpt2-size 124m
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.record import RESULTS, Run, module_argv, read_result, write_result
from gradmerge.estimate import estimate_diagonal, estimate_kfac_factors

Batch = tuple[Any, torch.Tensor]


# ----- measurement ----------------------------------------------------------------------------
class PeakMemory:
    """Peak memory above the starting level while the block runs (bytes)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak = device, 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            self.start, self.stop = _rss_anon(), threading.Event()
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, _rss_anon() - self.start)
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
        else:
            self.stop.set()
            self.thread.join()
            self.peak = max(self.peak, _rss_anon() - self.start)


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of ``fn()``."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu


def _load() -> float:
    """The 1-minute load average (other processes competing for the cores)."""
    return os.getloadavg()[0]


# ----- workloads ------------------------------------------------------------------------------
def mlp_workload(device: torch.device) -> tuple[nn.Module, list[Batch], str]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    ).to(device)
    data = [
        (torch.randn(256, 784, device=device), torch.randint(0, 10, (256,), device=device))
        for _ in range(16)
    ]
    return model, data, "MLP 784-512-512-10, batch 256, 4096 examples"


def gpt2_workload(device: torch.device, size: str) -> tuple[nn.Module, list[Batch], str]:
    import transformers

    torch.manual_seed(0)
    if size == "124m":
        config = transformers.GPT2Config(n_positions=512)  # GPT-2 small: 124M parameters
        batch, seq, batches = 4, 512, 1  # 2,048 tokens: each pass costs tens of s on 2 cores
    else:
        config = transformers.GPT2Config(
            n_layer=4, n_head=4, n_embd=256, vocab_size=2000, n_positions=128
        )
        batch, seq, batches = 8, 128, 4
    config.tie_word_embeddings = False
    model = transformers.GPT2LMHeadModel(config).to(device).eval()
    data = []
    for _ in range(batches):
        ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
        labels = torch.cat([ids[:, 1:], torch.full((batch, 1), -100, device=device)], dim=1)
        data.append(({"input_ids": ids}, labels))
    params = sum(p.numel() for p in model.parameters())
    desc = f"GPT-2 ({params / 1e6:.1f}M parameters), batch {batch}, sequence {seq}"
    return model, data, f"{desc}, {batches * batch * seq} tokens"


# ----- methods --------------------------------------------------------------------------------
def _loss(model: nn.Module, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )


def forward_backward(model: nn.Module, data: list[Batch]) -> None:
    for inputs, targets in data:
        model.zero_grad(set_to_none=True)
        _loss(model, inputs, targets).backward()


def vmap_empirical_diag(model: nn.Module, data: list[Batch]) -> None:
    """torch.func: per-example gradients by vmap(grad), squared and summed."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p: dict, x: Any, y: torch.Tensor) -> torch.Tensor:
        batch_x = {k: v[None] for k, v in x.items()} if isinstance(x, dict) else x[None]
        out = (
            torch.func.functional_call(model, p, (), batch_x)
            if isinstance(x, dict)
            else (torch.func.functional_call(model, p, (batch_x,)))
        )
        logits = out.logits if hasattr(out, "logits") else out
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y[None].reshape(-1), reduction="sum"
        )

    total = {k: torch.zeros_like(v) for k, v in params.items()}
    for inputs, targets in data:
        grads = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0))(params, inputs, targets)
        for k, g in grads.items():
            total[k] += (g**2).sum(0)


def backpack_method(extension: str) -> Callable[[nn.Module, list[Batch]], None]:
    def run(model: nn.Module, data: list[Batch]) -> None:
        import backpack
        from backpack import extensions

        ext = getattr(extensions, extension)()
        net = backpack.extend(model)
        loss_fn = backpack.extend(nn.CrossEntropyLoss(reduction="sum"))
        for inputs, targets in data:
            net.zero_grad(set_to_none=True)
            with backpack.backpack(ext):
                loss_fn(net(inputs), targets).backward()

    return run


def curvlinops_kfac(fisher_type: str) -> Callable[[nn.Module, list[Batch]], None]:
    def run(model: nn.Module, data: list[Batch]) -> None:
        from curvlinops import KFACLinearOperator

        params = [p for p in model.parameters() if p.requires_grad]
        op = KFACLinearOperator(
            model,
            nn.CrossEntropyLoss(reduction="sum"),
            params,
            data,
            fisher_type=fisher_type,
            mc_samples=1,
            check_deterministic=False,
        )
        op.compute_kronecker_factors()  # curvlinops computes lazily

    return run


def methods(workload: str) -> dict[str, Callable[[nn.Module, list[Batch]], object]]:
    out: dict[str, Callable[[nn.Module, list[Batch]], object]] = {
        "gradmerge diag empirical": lambda m, d: estimate_diagonal(m, d, fisher="empirical"),
        "gradmerge diag mc(1)": lambda m, d: estimate_diagonal(m, d, fisher="mc"),
        "gradmerge kfac empirical": lambda m, d: estimate_kfac_factors(m, d, fisher="empirical"),
        "gradmerge kfac mc(1)": lambda m, d: estimate_kfac_factors(m, d, fisher="mc"),
        "torch.func vmap empirical diag": vmap_empirical_diag,
    }
    if workload == "mlp":  # exact GGNs cost one backward per class: fine for 10 classes
        out["gradmerge diag ggn"] = lambda m, d: estimate_diagonal(m, d, fisher="ggn")
        out["gradmerge kfac ggn"] = lambda m, d: estimate_kfac_factors(m, d, fisher="ggn")
        out["backpack SumGradSquared"] = backpack_method("SumGradSquared")
        out["backpack DiagGGNExact"] = backpack_method("DiagGGNExact")
        out["backpack DiagGGNMC(1)"] = backpack_method("DiagGGNMC")
        out["curvlinops kfac empirical"] = curvlinops_kfac("empirical")
        out["curvlinops kfac mc(1)"] = curvlinops_kfac("mc")
        out["curvlinops kfac type-2"] = curvlinops_kfac("type-2")
    return out


def run_workload(
    name: str, model: nn.Module, data: list[Batch], device: torch.device, args: argparse.Namespace
) -> dict:
    forward_backward(model, data)  # warm-up
    base_memory = probe_memory(name, "forward+backward", args)
    results: dict[str, Any] = {"forward+backward": {"peak_memory_bytes": base_memory}}
    for label, method in methods(name).items():
        try:
            method(model, data)  # warm-up (and a first check that it runs)
        except Exception as err:  # a peer that does not support the model
            results[label] = {"status": f"unsupported: {type(err).__name__}: {str(err)[:160]}"}
            print(f"  {label:34s} {results[label]['status'][:90]}", flush=True)
            continue
        ratios, cpu_ratios, seconds, base_seconds, loads = [], [], [], [], [_load()]
        for _ in range(args.repeats):  # interleaved with the baseline, against drift
            base_s, base_cpu = _timed(lambda: forward_backward(model, data), device)
            s, cpu = _timed(lambda method=method: method(model, data), device)
            ratios.append(s / base_s)
            cpu_ratios.append(cpu / base_cpu if base_cpu > 0 else float("nan"))
            seconds.append(s)
            base_seconds.append(base_s)
        loads.append(_load())
        memory = probe_memory(name, label, args)
        results[label] = {
            "status": "ok",
            "seconds": statistics.median(seconds),
            "time_ratio": statistics.median(ratios),
            "time_ratio_min": min(ratios),
            "time_ratio_max": max(ratios),
            "time_ratio_of_minima": min(seconds) / min(base_seconds),
            "cpu_time_ratio": statistics.median(cpu_ratios),
            "load_average": [round(v, 2) for v in loads],
            "peak_memory_bytes": memory,
            "peak_memory_ratio": memory / base_memory if base_memory > 0 else None,
        }
        r = results[label]
        mem = f"{r['peak_memory_ratio']:6.2f}× memory" if r["peak_memory_ratio"] else ""
        print(
            f"  {label:34s} {r['time_ratio']:6.2f}× time ({min(ratios):.2f}–{max(ratios):.2f}, "
            f"min/min {r['time_ratio_of_minima']:.2f}×, cpu {r['cpu_time_ratio']:.2f}×)  {mem}  "
            f"load {loads[0]:.1f}→{loads[-1]:.1f}",
            flush=True,
        )
    return results


def probe_memory(workload: str, method: str, args: argparse.Namespace) -> int:
    """Peak memory of one run of ``method`` in a fresh process (no allocator reuse)."""
    cmd = module_argv("curvature", "--probe", workload, method, "--device", args.device)
    cmd += ["--gpt2-size", args.gpt2_size]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return int(json.loads(done.stdout.strip().splitlines()[-1])["peak_memory_bytes"])


PRELOADED = ("backpack", "curvlinops", "torch.fx.experimental.symbolic_shapes")
"""Imported before every memory probe, so that no method is charged for a one-time library
import: the peers' packages, and torch's symbolic-shapes module (it pulls in sympy, ~33 MB),
which ``torch.autograd.grad`` imports the first time it is given ``grad_outputs``."""


def _preload() -> None:
    for module in PRELOADED:
        with contextlib.suppress(ImportError):  # a missing peer is reported as unsupported
            importlib.import_module(module)


def _probe(workload: str, method: str, args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    _preload()
    model, data, _ = build(workload, device, args.gpt2_size)
    run = (
        (lambda: forward_backward(model, data))
        if method == "forward+backward"
        else (lambda: methods(workload)[method](model, data))
    )
    gc.collect()
    with PeakMemory(device) as mem:
        run()
    print(json.dumps({"peak_memory_bytes": mem.peak}))


def build(name: str, device: torch.device, gpt2_size: str) -> tuple[nn.Module, list[Batch], str]:
    return mlp_workload(device) if name == "mlp" else gpt2_workload(device, gpt2_size)


# (estimator, its target ratio or None, the peers doing the same work) per workload. The issue
# sets ratio targets for the empirical Fisher's diagonal and K-FAC factors; every estimator with
# a peer must also be no slower than the fastest one.
TARGETS: dict[str, list[tuple[str, float | None, list[str]]]] = {
    "mlp": [
        (
            "gradmerge diag empirical",
            1.5,
            ["backpack SumGradSquared", "torch.func vmap empirical diag"],
        ),
        ("gradmerge kfac empirical", 1.5, ["curvlinops kfac empirical"]),
        ("gradmerge diag mc(1)", None, ["backpack DiagGGNMC(1)"]),
        ("gradmerge diag ggn", None, ["backpack DiagGGNExact"]),
        ("gradmerge kfac mc(1)", None, ["curvlinops kfac mc(1)"]),
        ("gradmerge kfac ggn", None, ["curvlinops kfac type-2"]),
    ],
    "gpt2": [
        ("gradmerge diag empirical", 2.0, ["torch.func vmap empirical diag"]),
        ("gradmerge kfac empirical", 2.0, []),
    ],
}


def evaluate_targets(workloads: dict) -> list[dict]:
    """Each target: the ratio, whether it is met, and the fastest peer on the same work — by the
    median of paired ratios, and again by the ratio of minima (robust to intermittent load)."""
    out = []
    for name, targets in TARGETS.items():
        if name not in workloads:
            continue
        results = workloads[name]["methods"]
        for method, limit, peers in targets:
            entry: dict[str, Any] = {"workload": name, "method": method, "target": limit}
            for key, suffix in (("time_ratio", ""), ("time_ratio_of_minima", "_by_minima")):
                ours = results.get(method, {}).get(key)
                peer_ratios = {
                    p: results[p][key] for p in peers if results.get(p, {}).get("status") == "ok"
                }
                fastest = min(peer_ratios.items(), key=lambda kv: kv[1]) if peer_ratios else None
                entry[key] = ours
                entry["meets_target" + suffix] = (
                    None if limit is None else ours is not None and ours <= limit
                )
                entry["fastest_peer" + suffix] = fastest[0] if fastest else None
                entry["fastest_peer_ratio" + suffix] = fastest[1] if fastest else None
                entry["not_slower_than_peers" + suffix] = ours is not None and (
                    not fastest or ours <= fastest[1]
                )
            out.append(entry)
    return out


def _noisy(report: dict) -> str | None:
    """Why the timings are not to be trusted (the cores were oversubscribed), or None."""
    cores = os.cpu_count() or 1
    loads = [
        load
        for workload in report["workloads"].values()
        for result in workload["methods"].values()
        for load in result.get("load_average", [])
    ]
    worst = max(loads, default=0.0)
    if worst < cores:
        return None
    return (
        f"the load average reached {worst:.1f} on {cores} cores: other processes competed for "
        "them, the ratios are noisy (see each method's time_ratio_min/max); re-run on an idle "
        "machine"
    )


def repeated_runs(args: argparse.Namespace) -> None:
    """``--runs N``: the benchmark N times, each in a fresh process; per target, every run's
    ratio and their median (the report's ``targets`` use the medians)."""
    import statistics
    import subprocess
    import tempfile

    device = torch.device(args.device)
    out = Path(args.out or RESULTS / f"curvature-{device.type}-runs.json")
    run = Run("curvature", settings=vars(args))
    argv = list(sys.argv[1:])
    for flag in ("--runs", "--out"):  # drop these two (and their values) from the child's argv
        if flag in argv:
            i = argv.index(flag)
            del argv[i : i + 2]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            path = Path(tmp) / f"run{i}.json"
            print(f"--- run {i + 1} of {args.runs}", flush=True)
            subprocess.run(module_argv("curvature", *argv, "--out", str(path)), check=True)
            runs.append(read_result(path))
    targets = []
    for first in runs[0]["results"]["targets"]:
        same = [
            t
            for one in runs
            for t in one["results"]["targets"]
            if (t["workload"], t["method"]) == (first["workload"], first["method"])
        ]
        ratios = [t["time_ratio"] for t in same if t["time_ratio"] is not None]
        peers = [t["fastest_peer_ratio"] for t in same if t["fastest_peer_ratio"] is not None]
        median = statistics.median(ratios) if ratios else None
        targets.append(
            {
                "workload": first["workload"],
                "method": first["method"],
                "target": first["target"],
                "time_ratio_per_run": ratios,
                "time_ratio": median,
                "meets_target": None
                if first["target"] is None or median is None
                else median <= first["target"],
                "runs_meeting_target": None
                if first["target"] is None
                else sum(r <= first["target"] for r in ratios),
                "fastest_peer": first["fastest_peer"],
                "fastest_peer_ratio_per_run": peers,
                "fastest_peer_ratio": statistics.median(peers) if peers else None,
            }
        )
    report = {
        "how_to_read": "each run is `python -m benchmarks.curvature` in a fresh process (its full "
        "record under `runs`); targets: per-run median ratios and their median over the runs",
        "targets": targets,
        "runs": runs,
    }
    for t in targets:
        if t["time_ratio"] is None:
            continue
        spread = ", ".join(f"{r:.2f}" for r in t["time_ratio_per_run"])
        verdict = (
            ""
            if t["target"] is None
            else (
                f"; ≤ {t['target']}×: {'met' if t['meets_target'] else 'NOT met'} by the median, "
                f"{t['runs_meeting_target']} of {len(t['time_ratio_per_run'])} runs"
            )
        )
        print(
            f"target {t['workload']}/{t['method']}: median {t['time_ratio']:.2f}× ({spread}){verdict}"
        )
    write_result(out, run.finish(report))
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gpt2-size", choices=["small-config", "124m"], default="small-config")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument("--workloads", nargs="+", choices=["mlp", "gpt2"], default=["mlp", "gpt2"])
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="repeat the whole benchmark in this many fresh processes and report each target's "
        "median over them (run-to-run spread on a shared machine exceeds the in-run spread)",
    )
    parser.add_argument("--probe", nargs=2, metavar=("WORKLOAD", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.runs > 1:
        repeated_runs(args)
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.probe:
        _probe(*args.probe, args)
        return
    device = torch.device(args.device)
    run = Run("curvature", settings=vars(args))
    report: dict[str, Any] = {
        "how_to_read": (
            "time_ratio: median over `repeats` of (method wall time) / (plain forward+backward "
            "wall time over the same batches, measured just before it); time_ratio_min/max: "
            "the spread over repeats; time_ratio_of_minima: the fastest of the method's runs "
            "over the fastest forward+backward (each run's least disturbed time, robust to "
            "intermittent load); cpu_time_ratio: the median ratio of process CPU times (less "
            "sensitive to other processes on the machine, but it counts spinning threads); "
            "load_average: the 1-minute load before and after the method's repeats — on a "
            "machine whose load exceeds its cores, the ratios are noisy. Peak memory: above the "
            "level before the run, in a fresh process (RssAnon on CPU), ratio to forward+backward; "
            f"the modules {', '.join(PRELOADED)} are imported before it for every method (no "
            "method is charged for a one-time library import)."
        ),
        "workloads": {},
    }
    for name in args.workloads:
        model, data, desc = build(name, device, args.gpt2_size)
        print(f"{desc} on {device}", flush=True)
        report["workloads"][name] = {
            "description": desc,
            "methods": run_workload(name, model, data, device, args),
        }
    report["noisy"] = _noisy(report)
    if report["noisy"]:
        print(f"WARNING: {report['noisy']}")
    report["targets"] = evaluate_targets(report["workloads"])
    for t in report["targets"]:
        peer = (
            f", fastest peer {t['fastest_peer']} {t['fastest_peer_ratio']:.2f}×"
            if t["fastest_peer"]
            else ""
        )
        target = (
            f"≤ {t['target']}×: {'met' if t['meets_target'] else 'NOT met'}"
            if t["target"] is not None
            else "no ratio target"
        )
        if t["time_ratio"] is None:
            print(f"target {t['workload']}/{t['method']}: not measured")
            continue
        print(
            f"target {t['workload']}/{t['method']}: {t['time_ratio']:.2f}× "
            f"(min/min {t['time_ratio_of_minima']:.2f}×; {target}{peer})"
        )
    out = Path(args.out or RESULTS / f"curvature-{device.type}.json")
    write_result(out, run.finish(report))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
