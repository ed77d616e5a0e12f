"""Merge benchmarks: bandwidth roofline, side by side with the paper's script and mergekit, peak
memory of a streaming merge bigger than half of RAM, and K-FAC against dense solves.

Sections (each writes its part of the JSON report; ratios are measured in the same run):

(a) ``roofline``/``diagonal``/``streaming``: the bandwidth of fused single-pass torch kernels
    (addcmul, add, copy with ``out=``, into preallocated memory) over tensors of the merge's size
    is the roofline (an addcmul that allocates its output, and ``write()`` of a prefaulted buffer
    into the page cache, are recorded beside it: neither is a roofline, both are costs a merge
    that returns or writes a fresh result pays). A diagonal merge must at least read θ_LLM, every
    θ_t and H_t and write θ once: (2 + 2T)·n·4 bytes for Eq. 6, (2 + T)·n·4 for task arithmetic.
    Its throughput is those bytes over its time, as a fraction of the roofline, for the in-memory
    ``gm.gradient_matching`` / ``gm.task_arithmetic`` on large flat tensors, with gradmerge's
    compiled single-loop kernels (``kernel=gradmerge.kernels.Fused("on")``; the first call's compile time is
    recorded) and with its chunked pass (``"off"``), next to a chunked implementation written in
    this file with preallocated buffers (a reference, not gradmerge code). ``streaming`` runs
    ``gradmerge.jobs.run_merge`` over safetensors files (warm page cache) in both modes; its
    time is also compared with the I/O floor measured in the same run: reading every input once
    through the same reader (a sum per tensor) plus writing the output's bytes through the same
    writer from memory already computed.
(a') ``gpt2sized``: tensors of ordinary size, where per-call costs show: Eq. 6 with diagonal H_t
    and a diagonal prior δ·I + C over 16 tensors of 2M float32 (GPT-2's larger matrices), 4
    tasks, in memory and streamed from safetensors, with the defaults (on a CPU: gradmerge's C
    loop) and with the chunked pass, each against ``torch.add(out=)`` over 16 tensors of 2M
    floats measured just before it in the same process; streamed also interleaved with an
    ablation of the engine's savings (the prior's values formed as a tensor first, a fresh output
    mapping per tensor), which must write the same bytes.
(b) ``gpt2``: GPT-2-124M-sized checkpoints (random weights from a config; two "fine-tunes" =
    base + noise; random positive diagonal curvatures), each method in a fresh process: the
    paper's reference formula on whole state dicts (everything loaded, Python lists of
    temporaries per tensor), gradmerge in memory, gradmerge streaming (Eq. 6 and task
    arithmetic), and mergekit's ``task_arithmetic`` (``mergekit-yaml``). Wall time of the whole
    process (start-up included) and of the work alone, peak RSS and peak anonymous memory
    (RssAnon, sampled from /proc every 5 ms), and agreement of the outputs.
(b') ``cli``: ``gradmerge merge`` against ``mergekit-yaml`` (task arithmetic of the same base and
    two fine-tunes), whole processes alternated, beside ``python -c "import torch"``.
(c) ``large``: peak memory of a streaming Eq. 6 merge whose inputs (base + 2 models + 2 diagonal
    curvatures) total more than half of RAM, in a fresh process; files are deleted afterwards.
(d) ``kfac``: Eq. 6 for one layer with K-FAC curvatures (one task: two Kronecker terms with the
    prior, solved exactly; two tasks: three terms, preconditioned CG) against a dense Cholesky
    solve of the same system, and the agreement of the two.

The machine's other load is recorded (``benchmarks.record``: before and after each run); on a
shared 2-core machine the timings move with it.

    python -m benchmarks.merge            # everything, writes benchmarks/results/merge-cpu.json
    python -m benchmarks.merge --quick    # a smoke run, small sizes (record in a temporary folder)
    python -m benchmarks.merge --sections roofline diagonal kfac
    python -m benchmarks.merge --sections gpt2sized --repeats 9 --update   # (a') only
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import Tensor

import gradmerge as gm
from benchmarks.record import (
    RESULTS,
    Run,
    load,
    machine,
    module_argv,
    output,
    proc_status,
    read_result,
    run_measured,
    timed,
    write_result,
)
from gradmerge.kernels import fused as _fused
from gradmerge.kernels import memory as _memory
from gradmerge.kernels import native as _native
from gradmerge.kernels import select

DELTA = 1e-3  # prior precision δ of every Eq. 6 merge here (H_0 = δ·I)
GiB = 1024**3


# ----- measurement ------------------------------------------------------------------------------
def _gbs(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


# ----- (a) roofline and diagonal merges ---------------------------------------------------------
def roofline(n: int, repeats: int) -> dict[str, Any]:
    """Bandwidth (GB/s, bytes read + written) of fused single-pass kernels over n floats."""
    a, b, c, out = (torch.rand(n) for _ in range(4))
    kernels = {
        "addcmul(a, b, c, out=)": (lambda: torch.addcmul(a, b, c, out=out), 4 * n * 4),
        "add(a, b, out=)": (lambda: torch.add(a, b, out=out), 3 * n * 4),
        "copy_": (lambda: out.copy_(a), 2 * n * 4),
        # not a roofline: the cost of a fresh output (glibc maps large blocks anew: page faults)
        "addcmul(a, b, c) allocating its output": (lambda: torch.addcmul(a, b, c), 4 * n * 4),
    }
    result: dict[str, Any] = {"elements": n, "kernels": {}}
    for name, (fn, nbytes) in kernels.items():
        times = timed(fn, repeats)
        result["kernels"][name] = {
            "seconds": statistics.median(times),
            "gb_per_s": _gbs(nbytes, statistics.median(times)),
            "gb_per_s_best": _gbs(nbytes, min(times)),
        }
    kernels_out = [v for k, v in result["kernels"].items() if "allocating" not in k]
    result["roofline_gb_per_s"] = max(k["gb_per_s"] for k in kernels_out)
    result["roofline_gb_per_s_best"] = max(k["gb_per_s_best"] for k in kernels_out)
    return result


def page_cache_write(n: int, repeats: int, folder: Path) -> dict[str, Any]:
    """GB/s of writing n prefaulted floats to a new file through ``ShardedWriter`` (page cache,
    no fsync): what a streamed merge pays for its output on top of the merge itself."""
    from gradmerge.io.writer import ShardedWriter

    data = torch.rand(n)
    times = []
    for i in range(repeats + 1):
        target = folder / f"write-{i}"
        target.mkdir()
        start = time.perf_counter()
        writer = ShardedWriter(target, [("w", (n,), torch.float32)], 1 << 62)
        writer.write("w", data)
        writer.finish()
        times.append(time.perf_counter() - start)
        shutil.rmtree(target)
    times = times[1:]
    return {
        "seconds": statistics.median(times),
        "gb_per_s": _gbs(n * 4, statistics.median(times)),
        "gb_per_s_best": _gbs(n * 4, min(times)),
    }


def throughput(times: list[float], nbytes: int, roof: dict[str, float]) -> dict[str, float]:
    """Seconds and GB/s (median, best) of a merge moving at least ``nbytes``, and their fraction
    of the roofline measured the same way (median against median, best against best)."""
    median, best = statistics.median(times), min(times)
    return {
        "seconds": median,
        "seconds_best": best,
        "min_bytes_moved": nbytes,
        "gb_per_s": _gbs(nbytes, median),
        "fraction_of_roofline": _gbs(nbytes, median) / roof["roofline_gb_per_s"],
        "fraction_of_roofline_best": _gbs(nbytes, best) / roof["roofline_gb_per_s_best"],
    }


def make_flat(n: int, tasks: int, pieces: int = 4, seed: int = 0) -> tuple[dict, list, list]:
    """θ_LLM, θ_t and diagonal H_t as dicts of ``pieces`` large float32 tensors (n in total)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [n // pieces] * pieces
    base = {f"w{i}": torch.randn(s, generator=g) for i, s in enumerate(sizes)}
    fts = [{k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}]
    for _ in range(tasks - 1):
        fts.append({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()})
    hs = [{k: torch.rand(v.shape, generator=g) * 10 for k, v in base.items()} for _ in fts]
    return base, fts, hs


def fused_diagonal_merge(
    base: dict[str, Tensor],
    fts: list[dict[str, Tensor]],
    hs: list[dict[str, Tensor]],
    delta: float,
    alphas: list[float],
    chunk: int = 1 << 18,
) -> dict[str, Tensor]:
    """Eq. 6 with diagonal H_t in one pass over memory: chunks small enough for the cache.

    θ = θ_LLM + (Σ_t α_t (δ + h_t) ⊙ (θ_t − θ_LLM)) ⊘ (δ + Σ_t α_t h_t), computed chunk by chunk
    into preallocated buffers (a benchmark reference, not gradmerge code).
    """
    out = {}
    tau, weight, num, den = (torch.empty(chunk) for _ in range(4))
    for k, b in base.items():
        result = torch.empty_like(b)
        for s in range(0, b.numel(), chunk):
            e = min(s + chunk, b.numel())
            m = e - s
            bk = b[s:e]
            nu, de, ta, we = num[:m], den[:m], tau[:m], weight[:m]
            nu.zero_()
            de.fill_(delta)
            for alpha, ft, h in zip(alphas, fts, hs, strict=True):
                torch.sub(ft[k][s:e], bk, out=ta)
                hk = h[k][s:e]
                torch.add(hk, delta, out=we)
                nu.addcmul_(we, ta, value=alpha)
                de.add_(hk, alpha=alpha)
            torch.div(nu, de, out=ta)
            torch.add(bk, ta, out=result[s:e])
        out[k] = result
    return out


def peak_anon_during(fn: Callable[[], object]) -> int:
    """Peak growth of this process's anonymous memory while ``fn`` runs (bytes)."""
    gc.collect()
    start, peak, stop = proc_status()["RssAnon"], [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc_status()["RssAnon"] - start)
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        stop.set()
        thread.join()
    return max(peak[0], proc_status()["RssAnon"] - start)


def diagonal_in_memory(n: int, tasks: int, repeats: int, roof: dict[str, Any]) -> dict[str, Any]:
    base, fts, hs = make_flat(n, tasks)
    curvatures = [gm.Diagonal(h) for h in hs]
    alphas = [1.0] * tasks
    eq6_bytes, ta_bytes = (2 + 2 * tasks) * n * 4, (2 + tasks) * n * 4
    out_bytes = n * 4

    def eq6() -> Any:
        return gm.gradient_matching(base, fts, curvatures, prior=DELTA, kernel=select())

    def ta() -> Any:
        return gm.task_arithmetic(base, fts, kernel=select())

    methods: dict[str, tuple[Callable[[], Any], int, str | None]] = {
        "gm.gradient_matching (diagonal, Eq. 6), compiled kernel": (eq6, eq6_bytes, "on"),
        "gm.gradient_matching (diagonal, Eq. 6), chunked pass": (eq6, eq6_bytes, "off"),
        "gm.task_arithmetic, compiled kernel": (ta, ta_bytes, "on"),
        "gm.task_arithmetic, chunked pass": (ta, ta_bytes, "off"),
        "single-pass chunked Eq. 6 (benchmark reference)": (
            lambda: fused_diagonal_merge(base, fts, hs, DELTA, alphas),
            eq6_bytes,
            None,
        ),
    }
    result: dict[str, Any] = {
        "elements": n,
        "tasks": tasks,
        "tensor_elements": n // 4,
        "compiled_kernel_from_elements": _fused.MIN_NUMEL,
        "methods": {},
    }
    for name, (fn, nbytes, mode) in methods.items():
        with gm.fused_kernels(mode or "off"):
            start = time.perf_counter()
            fn()  # the warm-up: for a compiled kernel, its compile (once per process)
            first = time.perf_counter() - start
            r = throughput(timed(fn, repeats, warmup=False), nbytes, roof)
            anon = peak_anon_during(fn)
        r |= {"first_call_seconds": first, "fused_kernels": mode}
        r |= {"peak_extra_anon_bytes": anon, "peak_extra_anon_in_outputs": anon / out_bytes}
        result["methods"][name] = r
        print(
            f"  {name:58s} {r['gb_per_s']:6.2f} GB/s = {r['fraction_of_roofline']:5.2f} of "
            f"roofline (best {r['fraction_of_roofline_best']:4.2f}), temporaries "
            f"{anon / out_bytes:4.1f}× the output, first call {first:5.2f} s",
            flush=True,
        )
    with gm.fused_kernels("on"):
        compiled = eq6()
    with gm.fused_kernels("off"):
        chunked = eq6()
    reference = fused_diagonal_merge(base, fts, hs, DELTA, alphas)
    result["compiled_equals_chunked_bitwise"] = all(
        torch.equal(compiled[k], chunked[k]) for k in base
    )
    result["reference_max_abs_difference"] = max(
        float((compiled[k] - reference[k]).abs().max()) for k in compiled
    )
    return result


def write_flat_checkpoints(folder: Path, n: int, tasks: int, pieces: int = 4) -> dict[str, Any]:
    """base/ft/curvature safetensors of the flat problem; returns the paths and total bytes."""
    from safetensors.torch import save_file

    base, fts, hs = make_flat(n, tasks, pieces)
    paths: dict[str, Any] = {"base": folder / "base.safetensors", "models": [], "curvatures": []}
    save_file(base, str(paths["base"]))
    for t, (ft, h) in enumerate(zip(fts, hs, strict=True)):
        paths["models"].append(folder / f"ft{t}.safetensors")
        save_file(ft, str(paths["models"][-1]))
        paths["curvatures"].append(gm.Diagonal(h).save(folder / f"ft{t}.curvature.safetensors"))
    paths["input_bytes"] = sum(
        p.stat().st_size for p in [paths["base"], *paths["models"], *paths["curvatures"]]
    )
    return paths


def merge_config(paths: dict[str, Any], method: str, dtype: str | None = None) -> Any:
    from gradmerge.jobs import MergeConfig

    models = []
    for t, model in enumerate(paths["models"]):
        entry: dict[str, Any] = {"model": str(model), "alpha": 1.0}
        if method != "task_arithmetic":
            entry["curvature"] = str(paths["curvatures"][t])
        models.append(entry)
    spec: dict[str, Any] = {"method": method, "base_model": str(paths["base"]), "models": models}
    if method == "gradient_matching":
        spec["prior"] = {"delta": DELTA}
    if dtype:
        spec["dtype"] = dtype
    return MergeConfig.from_dict(spec, root=Path(paths["base"]).parent)


def diagonal_streaming(
    n: int, tasks: int, repeats: int, roof: dict[str, Any], tmp: Path
) -> dict[str, Any]:
    """run_merge over safetensors files in the page cache, output to a folder on the same disk,
    against the I/O floor of the same job (module docstring)."""
    from gradmerge.io import open_checkpoint
    from gradmerge.jobs import run_merge

    folder = tmp / "flat"
    folder.mkdir()
    paths = write_flat_checkpoints(folder, n, tasks)
    write = page_cache_write(n, repeats, folder)
    inputs = [paths["base"], *paths["models"], *paths["curvatures"]]

    def read_all() -> None:
        for path in inputs:
            with open_checkpoint(path) as ckpt:
                for key in ckpt:
                    ckpt.get(key).sum()

    read = statistics.median(timed(read_all, repeats))
    floors = {"gradient_matching": read + write["seconds"]}
    floors["task_arithmetic"] = read * (1 + tasks) / (1 + 2 * tasks) + write["seconds"]
    result: dict[str, Any] = {
        "elements": n,
        "tasks": tasks,
        "note": "inputs read back from the page cache (written just before); output written to "
        "the page cache of the same file system (no fsync); each repeat writes a new folder",
        "io_floor": {
            "read_every_input_once_seconds": read,
            "write_output_seconds": write["seconds"],
            "page_cache_write_gb_per_s": write["gb_per_s"],
            "gradient_matching_seconds": floors["gradient_matching"],
            "task_arithmetic_seconds": floors["task_arithmetic"],
        },
        "methods": {},
    }
    print(
        f"  I/O floor: read inputs once {read:.3f} s, write output {write['seconds']:.3f} s "
        f"({write['gb_per_s']:.2f} GB/s into the page cache)",
        flush=True,
    )
    for method, nbytes in (
        ("gradient_matching", (2 + 2 * tasks) * n * 4),
        ("task_arithmetic", (2 + tasks) * n * 4),
    ):
        config = merge_config(paths, method)
        for mode in ("on", "off"):
            times = []
            with gm.fused_kernels(mode):
                for i in range(repeats + 1):  # the first: warm-up (and the kernel's compile)
                    out = folder / f"out-{i}"
                    gc.collect()
                    start = time.perf_counter()
                    run_merge(config, out, progress=False)
                    times.append(time.perf_counter() - start)
                    # deleted at once (untimed): dirty pages of earlier outputs piling up in the
                    # page cache would throttle later writes to the disk's speed
                    shutil.rmtree(out)
            times = times[1:]
            r = throughput(times, nbytes, roof)
            r["fraction_of_io_floor"] = floors[method] / r["seconds"]
            kind = "compiled kernel" if mode == "on" else "chunked pass"
            result["methods"][f"run_merge {method} (streaming), {kind}"] = r
            print(
                f"  run_merge {method:18s} {kind:16s} {r['gb_per_s']:6.2f} GB/s = "
                f"{r['fraction_of_roofline']:5.2f} of roofline (best "
                f"{r['fraction_of_roofline_best']:4.2f}), {r['fraction_of_io_floor']:4.2f} of "
                "the I/O floor",
                flush=True,
            )
    shutil.rmtree(folder)
    return result


# ----- (a') GPT-2-sized tensors: many calls of ordinary size -----------------------------------
def add_roofline(tensors: int, n: int, repeats: int) -> dict[str, Any]:
    """GB/s of ``torch.add(a, b, out=)`` over ``tensors`` tensors of n floats: the same three
    buffers each time (they may stay partly in the last-level cache) and distinct ones (every
    call from memory). The larger is the roofline: the stricter comparison."""
    same = [torch.rand(n) for _ in range(3)]
    distinct = [[torch.rand(n) for _ in range(3)] for _ in range(tensors)]
    nbytes = tensors * 3 * n * 4
    kernels = {
        "add(a, b, out=), the same buffers": lambda: [
            torch.add(same[0], same[1], out=same[2]) for _ in range(tensors)
        ],
        "add(a, b, out=), distinct buffers": lambda: [
            torch.add(a, b, out=c) for a, b, c in distinct
        ],
    }
    result: dict[str, Any] = {"tensors": tensors, "tensor_elements": n, "kernels": {}}
    for name, fn in kernels.items():
        times = timed(fn, repeats)
        result["kernels"][name] = {
            "seconds": statistics.median(times),
            "gb_per_s": _gbs(nbytes, statistics.median(times)),
            "gb_per_s_best": _gbs(nbytes, min(times)),
        }
    result["roofline_gb_per_s"] = max(k["gb_per_s"] for k in result["kernels"].values())
    result["roofline_gb_per_s_best"] = max(k["gb_per_s_best"] for k in result["kernels"].values())
    return result


@contextlib.contextmanager
def _ablation() -> Iterator[None]:
    """The streaming engine without its two savings for elementwise priors: H_0 = s·C + δ formed
    as a tensor before the merge (``C.scaled(s) + δ``, not in the C loop) and a freshly mapped
    output per tensor (no ``_memory.recycling``). Same result bit for bit."""
    from gradmerge.jobs import opening  # looks up the prior's builder, precision, at call time

    def eager(delta: float, scale: float, c: gm.Curvature | None) -> Any:
        return delta if c is None else c.scaled(scale) + delta

    with (
        mock.patch.object(opening, "precision", eager),
        mock.patch.object(_memory, "recycling", contextlib.nullcontext),
    ):
        yield


def gpt2_sized(tensors: int, n: int, tasks: int, repeats: int, tmp: Path) -> dict[str, Any]:
    """Eq. 6 with diagonal H_t and a diagonal prior over ``tensors`` tensors of n float32 (issue
    14 item 3: 16 × 2M, 4 tasks), in memory and streamed, against :func:`add_roofline` measured
    just before each method (same process)."""
    from safetensors.torch import save_file

    from gradmerge.jobs import MergeConfig, run_merge

    g = torch.Generator().manual_seed(0)
    keys = [f"h.{i}.w" for i in range(tensors)]
    base = {k: torch.randn(n, generator=g) for k in keys}
    fts = [
        {k: v + 0.01 * torch.randn(n, generator=g) for k, v in base.items()} for _ in range(tasks)
    ]
    hs = [{k: torch.rand(n, generator=g) * 10 for k in keys} for _ in range(tasks)]
    prior_c = {k: torch.rand(n, generator=g) for k in keys}
    prior = gm.Diagonal({k: v + DELTA for k, v in prior_c.items()})  # δ·I + C, as the config says
    curvatures = [gm.Diagonal(h) for h in hs]
    nbytes = (3 + 2 * tasks) * tensors * n * 4  # θ_LLM, θ_t, h_t, h_0 read once; θ written once

    folder = tmp / "gpt2-sized"
    folder.mkdir()
    save_file(base, str(folder / "base.safetensors"))
    save_file(prior_c, str(folder / "prior.safetensors"))
    models = []
    for t in range(tasks):
        save_file(fts[t], str(folder / f"ft{t}.safetensors"))
        curvatures[t].save(folder / f"ft{t}.curvature.safetensors")
        models.append({"model": f"ft{t}.safetensors", "curvature": f"ft{t}.curvature.safetensors"})
    gm.Diagonal(prior_c).save(folder / "prior.curvature.safetensors")
    config = MergeConfig.from_dict(
        {
            "method": "gradient_matching",
            "base_model": "base.safetensors",
            "models": models,
            "prior": {"delta": DELTA, "curvature": "prior.curvature.safetensors"},
        },
        root=folder,
    )

    def in_memory() -> Any:  # the kernel of the mode in force (gm.fused_kernels), as the engine
        return gm.gradient_matching(base, fts, curvatures, prior=prior, kernel=select())

    outputs = iter(range(10**6))

    def streamed() -> float:
        """One run_merge into a new folder; its seconds (deleting the folder is not timed)."""
        out = folder / f"out-{next(outputs)}"
        start = time.perf_counter()
        run_merge(config, out, progress=False)
        seconds = time.perf_counter() - start
        shutil.rmtree(out)  # deleted at once: dirty pages piling up would throttle later writes
        return seconds

    def timed_call(fn: Callable[[], object]) -> float:
        """The seconds of one call (``streamed`` times itself)."""
        start = time.perf_counter()
        seconds = fn()
        return seconds if isinstance(seconds, float) else time.perf_counter() - start

    result: dict[str, Any] = {
        "tensors": tensors,
        "tensor_elements": n,
        "tasks": tasks,
        "prior": "diagonal (δ·I + C)",
        "min_bytes_moved": nbytes,
        "native_loop_from_elements": _native.MIN_NUMEL,
        "streamed_timing": "run_merge alone (deleting the output folder afterwards is not timed)",
        "methods": {},
    }
    for name, fn in {
        "gm.gradient_matching in memory": in_memory,
        "run_merge (streaming, safetensors in the page cache)": streamed,
    }.items():
        for mode, label in (("auto", "default (C loop)"), ("off", "chunked pass")):
            roof = add_roofline(tensors, n, repeats)
            with gm.fused_kernels(mode):
                first = timed_call(fn)  # the first call (in a fresh process: loading the C loop)
                times = []
                for _ in range(repeats):
                    gc.collect()
                    times.append(timed_call(fn))
                r = throughput(times, nbytes, roof)
            r |= {"first_call_seconds": first, "fused_kernels": mode, "roofline": roof}
            result["methods"][f"{name}, {label}"] = r
            print(
                f"  {name + ', ' + label:75s} {r['seconds']:6.3f} s {r['gb_per_s']:6.2f} GB/s = "
                f"{r['fraction_of_roofline']:5.2f} of add(out=) at {roof['roofline_gb_per_s']:5.1f}"
                f" GB/s (best {r['fraction_of_roofline_best']:4.2f}), first call {first:5.2f} s",
                flush=True,
            )
    pairs: dict[str, list[float]] = {"default": [], "ablation": []}
    for _ in range(repeats):  # interleaved, so that the machine's load weighs on both alike
        for key, context in (("default", contextlib.nullcontext), ("ablation", _ablation)):
            with context():
                gc.collect()
                pairs[key].append(streamed())
    result["streamed_ablation"] = {
        "what": "run_merge with the C loop, interleaved with the same run without the engine's "
        "savings for elementwise priors (the prior's values formed as a tensor first, a fresh "
        "output mapping per tensor: _ablation)",
        "default_seconds": statistics.median(pairs["default"]),
        "ablation_seconds": statistics.median(pairs["ablation"]),
    }
    print(
        "  run_merge interleaved: default {default_seconds:.3f} s, prior formed first and fresh "
        "outputs {ablation_seconds:.3f} s".format(**result["streamed_ablation"]),
        flush=True,
    )
    with tempfile.TemporaryDirectory() as empty:  # building the C loop of this pattern anew
        pattern = "h" * (tasks + 1)  # every h_t a tensor (in memory; streamed: "a" + "h" * tasks)
        start = time.perf_counter()
        with mock.patch.dict(os.environ, {_native.CACHE_ENV: empty}):
            _native._cache_dir.cache_clear()
            _native._built(_native.source(pattern, "float"))
        result["c_loop_build_seconds"] = time.perf_counter() - start
        _native._cache_dir.cache_clear()
    print(f"  building the C loop of this pattern: {result['c_loop_build_seconds']:.2f} s")
    with gm.fused_kernels("auto"):
        loop = in_memory()
    with gm.fused_kernels("off"):
        chunked = in_memory()
    result["c_loop_equals_chunked_bitwise"] = all(torch.equal(loop[k], chunked[k]) for k in keys)
    written = []
    for context in (contextlib.nullcontext, _ablation):
        with context():
            run_merge(config, folder / f"kept-{len(written)}", progress=False)
        written.append((folder / f"kept-{len(written)}" / "model.safetensors").read_bytes())
    result["streamed_equals_ablation_bitwise"] = written[0] == written[1]
    shutil.rmtree(folder)
    return result


# ----- (b) GPT-2-124M side by side --------------------------------------------------------------
def build_gpt2(folder: Path, tasks: int = 2) -> dict[str, Any]:
    """A GPT-2-124M base (random weights), ``tasks`` noisy copies and diagonal curvatures."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    model.save_pretrained(folder / "base")
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    paths: dict[str, Any] = {"base": folder / "base", "models": [], "curvatures": []}
    g = torch.Generator().manual_seed(1)
    for t in range(tasks):
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(base[k] + 0.02 * torch.randn(p.shape, generator=g))
        model.save_pretrained(folder / f"ft{t}")
        h = {k: torch.exp(torch.randn(p.shape, generator=g)) for k, p in params.items()}
        paths["models"].append(folder / f"ft{t}")
        paths["curvatures"].append(gm.Diagonal(h).save(folder / f"ft{t}.curvature.safetensors"))
    paths["parameters"] = sum(p.numel() for p in params.values())
    return paths


def paper_reference_merge(
    base: dict[str, Tensor],
    models: list[dict[str, Tensor]],
    fishers: list[dict[str, Tensor]],
    alphas: list[float],
    delta: float,
) -> dict[str, Tensor]:
    """The paper's formula as its script writes it: whole state dicts, lists of temporaries.

    θ = θ_LLM + Σ_t α_t (F_t + δ) ⊙ (θ_t − θ_LLM) / (δ + Σ_t α_t F_t), tensor by tensor.
    """
    merged = {}
    for name in base:
        task_vectors = [m[name] - base[name] for m in models]
        weighted = [
            a * (f[name] + delta) * tv
            for a, f, tv in zip(alphas, fishers, task_vectors, strict=True)
        ]
        norm = delta + sum([a * f[name] for a, f in zip(alphas, fishers, strict=True)])
        merged[name] = base[name] + sum(weighted) / norm
    return merged


def _load_folder(folder: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    out: dict[str, Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _probe(kind: str, spec: dict[str, Any]) -> None:
    """One measured job in this (fresh) process; prints its timings as a JSON line."""
    from safetensors.torch import save_file

    start = time.perf_counter()
    out = Path(spec["out"])
    paths: dict[str, Any] = {
        "base": Path(spec["base"]),
        "models": [Path(p) for p in spec["models"]],
        "curvatures": [Path(p) for p in spec["curvatures"]],
    }
    work_start = time.perf_counter()
    if kind in ("paper", "inmemory"):
        base = _load_folder(paths["base"]) if paths["base"].is_dir() else _load_any(paths["base"])
        models = [_load_folder(p) if p.is_dir() else _load_any(p) for p in paths["models"]]
        curvs = [gm.load_curvature(p) for p in paths["curvatures"]]
        loaded = time.perf_counter()
        if kind == "paper":
            fishers = [c.values for c in curvs]  # type: ignore[attr-defined]
            merged = paper_reference_merge(base, models, fishers, [1.0] * len(models), DELTA)
        else:
            merged = gm.gradient_matching(base, models, curvs, prior=DELTA, kernel=select())
        computed = time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in merged.items()}, str(out / "model.safetensors"))
        timings = {"load_seconds": loaded - work_start, "merge_seconds": computed - loaded}
    elif kind == "idle":  # start-up and resident memory of the interpreter with gradmerge
        import gradmerge.jobs  # noqa: F401

        timings = {}
    elif kind in ("stream-gm", "stream-ta"):
        from gradmerge.jobs import run_merge

        method = "gradient_matching" if kind == "stream-gm" else "task_arithmetic"
        run_merge(merge_config(paths, method), out, overwrite=True, progress=False)
        timings = {}
    else:
        raise SystemExit(f"unknown probe {kind}")
    done = time.perf_counter()
    print(
        json.dumps(
            {"work_seconds": done - work_start, "in_process_seconds": done - start, **timings}
        )
    )


def _load_any(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def probe(kind: str, paths: dict[str, Any], out: Path) -> dict[str, Any]:
    spec = {
        "base": str(paths["base"]),
        "models": [str(p) for p in paths["models"]],
        "curvatures": [str(p) for p in paths["curvatures"]],
        "out": str(out),
    }
    threads = os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads()))
    cmd = module_argv("merge", "--probe", kind, json.dumps(spec), "--threads", threads)
    return run_measured(cmd)


def mergekit_task_arithmetic(paths: dict[str, Any], out: Path) -> dict[str, Any]:
    import yaml

    config = {
        "models": [{"model": str(m), "parameters": {"weight": 1.0}} for m in paths["models"]],
        "base_model": str(paths["base"]),
        "merge_method": "task_arithmetic",
        "dtype": "float32",
    }
    path = out.parent / "mergekit.yaml"
    path.write_text(yaml.safe_dump(config))
    exe = str(Path(sys.executable).parent / "mergekit-yaml")
    return run_measured([exe, str(path), str(out), "--quiet"])


def _max_rel_difference(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    worst = 0.0
    for k in a:
        diff = float((a[k].double() - b[k].double()).abs().max())
        scale = float(b[k].double().abs().max()) or 1.0
        worst = max(worst, diff / scale)
    return worst


def gpt2_side_by_side(tmp: Path) -> dict[str, Any]:
    folder = tmp / "gpt2"
    folder.mkdir()
    paths = build_gpt2(folder)
    inputs = sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
    result: dict[str, Any] = {
        "parameters": paths["parameters"],
        "tasks": len(paths["models"]),
        "input_bytes": inputs,
        "prior_delta": DELTA,
        "methods": {},
    }
    runs = {
        "paper reference formula (whole state dicts, lists of temporaries)": ("paper", "paper"),
        "gradmerge in memory (gm.gradient_matching on state dicts)": ("inmemory", "inmemory"),
        "gradmerge streaming gradient_matching (run_merge)": ("stream-gm", "stream_gm"),
        "gradmerge streaming task_arithmetic (run_merge)": ("stream-ta", "stream_ta"),
    }
    result["startup"] = {
        "python -c 'import gradmerge.jobs' (probe doing nothing)": probe(
            "idle", paths, folder / "unused"
        ),
        "mergekit-yaml --help": run_measured(
            [str(Path(sys.executable).parent / "mergekit-yaml"), "--help"]
        ),
    }
    for label, r in result["startup"].items():
        _print_run(f"start-up: {label}", r)
    for label, (kind, name) in runs.items():
        result["methods"][label] = probe(kind, paths, folder / f"out_{name}")
        _print_run(label, result["methods"][label])
    label = "mergekit task_arithmetic (mergekit-yaml)"
    result["methods"][label] = mergekit_task_arithmetic(paths, folder / "out_mergekit")
    _print_run(label, result["methods"][label])
    outputs = {
        name: _load_folder(folder / f"out_{name}")
        for name in ("paper", "inmemory", "stream_gm", "stream_ta", "mergekit")
        if (folder / f"out_{name}").is_dir()
    }
    agreement: dict[str, Any] = {}
    if {"paper", "stream_gm"} <= set(outputs):
        agreement["streaming Eq. 6 vs paper formula (max relative difference)"] = (
            _max_rel_difference(outputs["stream_gm"], outputs["paper"])
        )
    if {"inmemory", "stream_gm"} <= set(outputs):
        agreement["streaming Eq. 6 vs in-memory Eq. 6 (max relative difference)"] = (
            _max_rel_difference(outputs["stream_gm"], outputs["inmemory"])
        )
    if {"mergekit", "stream_ta"} <= set(outputs):
        common = sorted(set(outputs["mergekit"]) & set(outputs["stream_ta"]))
        agreement["streaming task arithmetic vs mergekit: bit-equal tensors"] = (
            f"{sum(torch.equal(outputs['mergekit'][k], outputs['stream_ta'][k]) for k in common)}"
            f" of {len(common)} common tensors"
        )
        agreement["streaming task arithmetic vs mergekit (max relative difference)"] = (
            _max_rel_difference({k: outputs["stream_ta"][k] for k in common}, outputs["mergekit"])
        )
    result["agreement"] = agreement
    for k, v in agreement.items():
        print(f"  {k}: {v}", flush=True)
    del outputs
    shutil.rmtree(folder)
    return result


def _print_run(label: str, r: dict[str, Any]) -> None:
    if r.get("returncode"):
        print(f"  {label:68s} FAILED: {r.get('error')}", flush=True)
        return
    print(
        f"  {label:68s} {r['wall_seconds']:6.1f} s wall ({r.get('work_seconds', float('nan')):5.1f} s work), "
        f"peak RSS {r['peak_rss_bytes'] / GiB:5.2f} GiB, RssAnon {r['peak_rss_anon_bytes'] / GiB:5.2f} GiB",
        flush=True,
    )


def cli_task_arithmetic(tmp: Path, repeats: int) -> dict[str, Any]:
    """``gradmerge merge`` against ``mergekit-yaml``, task arithmetic of a GPT-2-124M base and two
    fine-tunes, each a fresh process run from the shell's point of view (start-up included),
    alternated ``repeats`` times, beside ``python -c "import torch"`` (what both pay first)."""
    import yaml

    folder = tmp / "cli"
    folder.mkdir()
    paths = build_gpt2(folder)
    ours = folder / "gradmerge.yaml"
    ours.write_text(
        yaml.safe_dump(
            {
                "method": "task_arithmetic",
                "base_model": str(paths["base"]),
                "models": [{"model": str(m), "alpha": 1.0} for m in paths["models"]],
            }
        )
    )
    theirs = folder / "mergekit.yaml"
    theirs.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {"model": str(m), "parameters": {"weight": 1.0}} for m in paths["models"]
                ],
                "base_model": str(paths["base"]),
                "merge_method": "task_arithmetic",
                "dtype": "float32",
            }
        )
    )
    bin_dir = Path(sys.executable).parent
    commands = {
        "gradmerge merge": [str(bin_dir / "gradmerge"), "merge", str(ours), "OUT", "--no-progress"],
        "mergekit-yaml --lazy-unpickle": [
            *(str(bin_dir / "mergekit-yaml"), str(theirs), "OUT"),
            *("--lazy-unpickle", "--quiet"),
        ],
        'python -c "import torch"': [sys.executable, "-c", "import torch"],
        'python -c "import gradmerge"': [sys.executable, "-c", "import gradmerge"],
    }
    walls: dict[str, list[float]] = {name: [] for name in commands}
    for i in range(repeats):
        for name, cmd in commands.items():
            out = folder / f"out-{i}"
            r = run_measured([str(out) if c == "OUT" else c for c in cmd])
            if r["returncode"]:
                raise RuntimeError(f"{name} failed: {r.get('error')}")
            walls[name].append(r["wall_seconds"])
            shutil.rmtree(out, ignore_errors=True)
    result: dict[str, Any] = {
        "parameters": paths["parameters"],
        "models": 1 + len(paths["models"]),
        "repeats": repeats,
        "wall_seconds": walls,
        "median_wall_seconds": {k: statistics.median(v) for k, v in walls.items()},
    }
    med = result["median_wall_seconds"]
    result["mergekit_over_gradmerge_median"] = (
        med["mergekit-yaml --lazy-unpickle"] / med["gradmerge merge"]
    )
    result["mergekit_over_gradmerge_per_round"] = [
        m / g
        for m, g in zip(
            walls["mergekit-yaml --lazy-unpickle"], walls["gradmerge merge"], strict=True
        )
    ]
    for name, v in med.items():
        print(f"  {name:34s} median {v:6.2f} s ({', '.join(f'{x:.1f}' for x in walls[name])})")
    print(f"  mergekit / gradmerge: {result['mergekit_over_gradmerge_median']:.2f}× (medians)")
    shutil.rmtree(folder)
    return result


# ----- (c) a streaming merge bigger than half of RAM --------------------------------------------
def write_large(folder: Path, gib_per_file: float, tasks: int = 2) -> dict[str, Any]:
    """Files of ~``gib_per_file`` each, written one at a time (4096×4096 float32 tensors)."""
    from safetensors.torch import save_file

    per_tensor = 4096 * 4096
    count = max(1, round(gib_per_file * GiB / (per_tensor * 4)))
    g = torch.Generator().manual_seed(0)

    def tensors(scale: float, offset: float = 0.0, positive: bool = False) -> dict[str, Tensor]:
        out = {}
        for i in range(count):
            t = (
                torch.rand(4096, 4096, generator=g)
                if positive
                else torch.randn(4096, 4096, generator=g)
            )
            out[f"layers.{i}.weight"] = t * scale + offset
        return out

    paths: dict[str, Any] = {"base": folder / "base.safetensors", "models": [], "curvatures": []}
    save_file(tensors(1.0), str(paths["base"]))
    gc.collect()
    for t in range(tasks):
        paths["models"].append(folder / f"ft{t}.safetensors")
        save_file(tensors(1.0), str(paths["models"][-1]))
        gc.collect()
        curvature = gm.Diagonal(tensors(10.0, 0.1, positive=True))
        paths["curvatures"].append(curvature.save(folder / f"ft{t}.curvature.safetensors"))
        del curvature
        gc.collect()
    paths["input_bytes"] = sum(
        p.stat().st_size for p in [paths["base"], *paths["models"], *paths["curvatures"]]
    )
    paths["tensors_per_file"] = count
    return paths


def large_streaming(tmp: Path, gib_per_file: float, mem_total: int) -> dict[str, Any]:
    free = shutil.disk_usage(tmp).free
    need = 6 * gib_per_file * GiB * 1.1
    if free < need:
        return {"status": f"skipped: {free / GiB:.1f} GiB free on {tmp}, need {need / GiB:.1f}"}
    folder = tmp / "large"
    folder.mkdir()
    try:
        start = time.perf_counter()
        paths = write_large(folder, gib_per_file)
        written = time.perf_counter() - start
        print(
            f"  wrote {paths['input_bytes'] / GiB:.1f} GiB of inputs in {written:.0f} s", flush=True
        )
        idle = probe("idle", paths, folder / "unused")
        run = probe("stream-gm", paths, folder / "out")
        out_bytes = sum(f.stat().st_size for f in (folder / "out").glob("*.safetensors"))
        result = {
            "input_bytes": paths["input_bytes"],
            "input_fraction_of_ram": paths["input_bytes"] / mem_total,
            "output_bytes": out_bytes,
            "tensors_per_file": paths["tensors_per_file"],
            "tensor_bytes": 4096 * 4096 * 4,
            "run": run,
            "idle_process": idle,
            "peak_rss_anon_above_idle_in_tensors": (
                run["peak_rss_anon_bytes"] - idle["peak_rss_anon_bytes"]
            )
            / (4096 * 4096 * 4),
        }
        _print_run("streaming gradient_matching, inputs > RAM/2", run)
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ----- (d) K-FAC against dense ------------------------------------------------------------------
def _spd(n: int, g: torch.Generator) -> Tensor:
    """A random SPD matrix (float64), eigenvalues in about [0.1, 3]."""
    x = torch.randn(n, 2 * n, generator=g, dtype=torch.float64)
    return x @ x.T / (2 * n) + 0.1 * torch.eye(n, dtype=torch.float64)


def kfac_layer(out_dim: int, in_dim: int, tasks: int, dense: bool, repeats: int) -> dict[str, Any]:
    """Eq. 6 on one linear layer (weight out × in) with K-FAC H_t, against a dense solve.

    Timings in float32 (repeated only for layers up to 1M parameters); the agreement of the two
    answers is checked in float64, where both solves are accurate to ~1e-12.
    """
    g = torch.Generator().manual_seed(out_dim * 7919 + in_dim + tasks)
    base64 = {"fc.weight": torch.randn(out_dim, in_dim, generator=g, dtype=torch.float64)}
    fts64 = [
        {
            "fc.weight": base64["fc.weight"]
            + torch.randn(base64["fc.weight"].shape, generator=g, dtype=torch.float64)
        }
        for _ in range(tasks)
    ]
    factors64 = [(_spd(in_dim, g), _spd(out_dim, g)) for _ in range(tasks)]

    def problem(dtype: torch.dtype) -> tuple[dict[str, Tensor], list, list]:
        base = {k: v.to(dtype) for k, v in base64.items()}
        fts = [{k: v.to(dtype) for k, v in ft.items()} for ft in fts64]
        return base, fts, [(a.to(dtype), gg.to(dtype)) for a, gg in factors64]

    def kfac_merge(dtype: torch.dtype) -> Tensor:
        base, fts, factors = problem(dtype)
        curvatures = [gm.KFAC({"fc": f}) for f in factors]
        return gm.gradient_matching(base, fts, curvatures, prior=DELTA)["fc.weight"].reshape(-1)

    def dense_merge(dtype: torch.dtype) -> Tensor:
        base, fts, factors = problem(dtype)
        n = out_dim * in_dim
        matrix = DELTA * torch.eye(n, dtype=dtype)
        rhs = torch.zeros(n, dtype=dtype)
        b = base["fc.weight"].reshape(-1)
        for (a, gg), ft in zip(factors, fts, strict=True):
            h = torch.kron(gg, a)  # V ↦ G V A on the row-major vec(V)
            matrix += h
            tau = ft["fc.weight"].reshape(-1) - b
            rhs += DELTA * tau + h @ tau
        chol = torch.linalg.cholesky(matrix)
        return b + torch.cholesky_solve(rhs[:, None], chol)[:, 0]

    small = out_dim * in_dim <= 1 << 20
    base, _, factors = problem(torch.float32)
    precision: gm.Curvature = gm.ScaledIdentity(DELTA)
    for f in factors:
        precision = precision + gm.KFAC({"fc": f})
    terms = len(precision.terms["fc"]) if isinstance(precision, gm.KFAC) else 0
    row: dict[str, Any] = {
        "layer": f"{out_dim}x{in_dim}",
        "parameters": out_dim * in_dim,
        "tasks": tasks,
        "kronecker_terms": terms,
        "kfac_solve": "exact (eigendecompositions)" if terms <= 2 else "preconditioned CG",
        "dtype": "float32",
    }
    if terms > 2 and small and isinstance(precision, gm.KFAC):
        part = precision.solve_info(_ones(base)).parts["fc"]
        row["cg_iterations"], row["cg_residual"] = part.iterations, part.residual
    times = timed(lambda: kfac_merge(torch.float32), repeats if small else 1, warmup=small)
    row["kfac_seconds"] = statistics.median(times)
    row["dense_matrix_bytes"] = (out_dim * in_dim) ** 2 * 4
    if dense:
        times = timed(lambda: dense_merge(torch.float32), max(1, repeats // 2))
        row["dense_seconds"] = statistics.median(times)
        row["speedup"] = row["dense_seconds"] / row["kfac_seconds"]
        merged, reference = kfac_merge(torch.float64), dense_merge(torch.float64)
        tau = float(torch.linalg.norm(reference - base64["fc.weight"].reshape(-1)))
        row["relative_difference_float64"] = float(torch.linalg.norm(merged - reference)) / tau
    else:
        row["dense"] = (
            f"not run: the dense matrix alone would take {row['dense_matrix_bytes'] / GiB:.0f} GiB"
        )
    return row


def _ones(like: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: torch.ones_like(v) for k, v in like.items()}


def kfac_section(sizes: list[tuple[int, int, bool]], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for out_dim, in_dim, dense in sizes:
        for tasks in (1, 2):
            row = kfac_layer(out_dim, in_dim, tasks, dense, repeats)
            rows.append(row)
            extra = (
                f"dense {row['dense_seconds'] * 1e3:9.1f} ms (dense/K-FAC {row['speedup']:6.3g}), "
                f"rel. diff (float64) {row['relative_difference_float64']:.1e}"
                if "dense_seconds" in row
                else row["dense"]
            )
            print(
                f"  {row['layer']:>10s} T={tasks} K-FAC {row['kfac_seconds'] * 1e3:8.2f} ms "
                f"[{row['kfac_solve']}]; {extra}",
                flush=True,
            )
    return rows


# ----- driver -----------------------------------------------------------------------------------
SECTIONS = ("roofline", "diagonal", "streaming", "gpt2sized", "gpt2", "cli", "large", "kfac")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--elements", type=int, default=None, help="flat merge size (64M)")
    parser.add_argument("--large-gib", type=float, default=None, help="GiB per file in (c) (2.75)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--tmp", default=None, help="scratch folder (default: a new one in /tmp)")
    parser.add_argument("--out", default=None, help="JSON path")
    parser.add_argument(
        "--update",
        action="store_true",
        help="keep the other sections (and the runs that measured them) of an existing record "
        "at --out",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads here and in every measured process (OMP_NUM_THREADS); default 1: on "
        "a shared 2-core machine, threads waiting on each other make small ops 1000× slower",
    )
    parser.add_argument("--probe", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    if args.probe:
        _probe(args.probe[0], json.loads(args.probe[1]))
        return
    n = args.elements or (1 << 22 if args.quick else 1 << 26)
    repeats = args.repeats or (2 if args.quick else 5)
    large_gib = args.large_gib or (0.05 if args.quick else 2.75)
    kfac_sizes = (
        [(16, 16, True), (32, 32, True), (256, 256, False)]
        if args.quick
        else [
            (16, 16, True),
            (32, 32, True),
            (64, 64, True),
            (96, 96, True),
            (768, 768, False),
            (3072, 768, False),
            (2048, 2048, False),
        ]
    )
    info = machine()
    default = RESULTS / "merge-cpu.json"
    out = output(args.out and Path(args.out), quick=args.quick, default=default, name="merge")
    record = Run("merge", settings=vars(args) | {"prior_delta": DELTA})
    report: dict[str, Any] = {}
    if args.update and out.is_file():  # keep the sections not run now, and the runs that made them
        report = read_result(out)["results"]
    run = {
        "command": record.command,
        "sections": args.sections,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "started": record.started,
        "load_before": record.load_before,
    }
    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="gradmerge-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    print(
        f"{info['cpu_model']}, {info['cpus']} cores, torch {info['torch']}; "
        f"load {record.load_before}; scratch {tmp}",
        flush=True,
    )
    try:
        roof = None
        if {"roofline", "diagonal", "streaming"} & set(args.sections):
            print(f"(a) roofline over {n:,} floats", flush=True)
            report["roofline"] = roofline(n, repeats)
            roof = report["roofline"]
            for k, v in report["roofline"]["kernels"].items():
                print(f"  {k:24s} {v['gb_per_s']:6.2f} GB/s (best {v['gb_per_s_best']:5.2f})")
        if "diagonal" in args.sections and roof:
            print(f"(a) diagonal merges in memory, T = 2, {n:,} parameters", flush=True)
            report["diagonal_in_memory"] = diagonal_in_memory(n, 2, repeats, roof)
        if "streaming" in args.sections and roof:
            print(f"(a) streaming merges over safetensors, T = 2, {n:,} parameters", flush=True)
            report["diagonal_streaming"] = diagonal_streaming(n, 2, repeats, roof, tmp)
        if "gpt2sized" in args.sections:
            sized = (16, 1 << 16) if args.quick else (16, 1 << 21)
            print(f"(a') Eq. 6, T = 4, {sized[0]} tensors × {sized[1]:,} floats", flush=True)
            report["gpt2_sized_tensors"] = gpt2_sized(*sized, 4, repeats, tmp)
        if "gpt2" in args.sections:
            print("(b) GPT-2-124M checkpoints, T = 2, fresh process per method", flush=True)
            report["gpt2_side_by_side"] = gpt2_side_by_side(tmp)
        if "cli" in args.sections:
            print(
                "(b') gradmerge merge vs mergekit-yaml, task arithmetic of 3 GPT-2-124M", flush=True
            )
            report["cli_task_arithmetic"] = cli_task_arithmetic(tmp, repeats)
        if "large" in args.sections:
            print(f"(c) streaming merge of 5 files × {large_gib} GiB", flush=True)
            report["large_streaming"] = large_streaming(tmp, large_gib, info["memory_bytes"])
        if "kfac" in args.sections:
            print("(d) K-FAC Eq. 6 per layer against a dense Cholesky solve", flush=True)
            report["kfac_vs_dense"] = kfac_section(kfac_sizes, repeats)
    finally:
        if args.tmp is None:
            shutil.rmtree(tmp, ignore_errors=True)
    run["load_after"] = load()
    report["runs"] = [*report.get("runs", []), run]
    report["targets"] = targets(report)
    for t in report["targets"]:
        print(
            f"target: {t['what']}: {t['value']:.2f} (≥ {t['target']}: "
            f"{'met' if t['met'] else 'NOT met'})"
        )
    write_result(out, record.finish(report))
    print(f"wrote {out}")


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets: diagonal merge throughput ≥ 0.7 of the roofline on CPU, and
    ≥ 0.5 of the roofline at GPT-2-sized tensors (16 × 2M floats, 4 tasks), in memory and
    streamed, with the default settings."""
    sections = {
        "": report.get("diagonal_in_memory", {}),
        "streaming, ": report.get("diagonal_streaming", {}),
    }
    out = []
    for prefix, section in sections.items():
        for name, m in section.get("methods", {}).items():
            if "benchmark reference" in name:
                continue
            out.append(
                {
                    "what": f"{prefix}{name}: fraction of the bandwidth roofline",
                    "value": m["fraction_of_roofline"],
                    "target": 0.7,
                    "met": m["fraction_of_roofline"] >= 0.7,
                }
            )
    for name, m in report.get("gpt2_sized_tensors", {}).get("methods", {}).items():
        if m["fused_kernels"] == "auto":
            out.append(
                {
                    "what": f"GPT-2-sized tensors, {name}: fraction of the add(out=) roofline",
                    "value": m["fraction_of_roofline"],
                    "target": 0.5,
                    "met": m["fraction_of_roofline"] >= 0.5,
                }
            )
    return out


if __name__ == "__main__":
    main()
