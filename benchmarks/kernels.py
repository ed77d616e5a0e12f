"""Does the generated C loop earn its place? End-to-end streamed diagonal merges, C loop against
``torch.compile``, interleaved.

Issue 20 item 4: the fast diagonal path of the streaming engine (``gradmerge.kernels``) builds a C
loop with the system compiler (``gradmerge.kernels.native``) for CPU float32/float64 tensors, and
uses ``torch.compile`` (inductor) everywhere else. If ``torch.compile`` comes within 10% end to
end, the maintained JIT should be preferred and the generator deleted. Two variants of the same
``gradmerge merge CONFIG OUT`` command, each a fresh process (start-up, loading or compiling the
kernels, reading, merging and writing all counted), alternated ``--repeats`` times so that the
machine's load weighs on both alike:

- ``c_loop``: the default (``$GRADMERGE_FUSED`` unset: the C loop takes every CPU float tensor of
  4096 elements or more; its shared library is cached on disk, built before the timed runs);
- ``torch_compile``: the C loop declines every tensor and ``torch.compile`` takes the same tensors
  (its size threshold lowered to the C loop's, mode ``on``; inductor's on-disk caches warm from a
  run before the timed ones).

Workloads (float32 safetensors in the page cache, Eq. 6 with diagonal curvatures, T = 2, prior
δ = 1e-3, and task arithmetic for GPT-2):

- ``gpt2``: GPT-2-124M (random weights from ``transformers.GPT2Config()``), as in
  ``benchmarks/merge.py``'s ``cli`` section;
- ``llama7b_blocks``: tensors of Llama-7B's shapes (hidden 4096, MLP 11008: q/k/v/o 4096×4096,
  gate/up 11008×4096, down 4096×11008, two RMSNorm weights) for ``--blocks`` decoder blocks — the
  full 32 blocks (27 GB per file) do not fit this machine's disk five times over.

Both variants' outputs are compared byte for byte. Results go to
``benchmarks/results/kernels-cpu.json`` (the suite's record, ``benchmarks.record``), with
``os.getloadavg()`` before and after each run; each workload names the run that measured it
(``run``: command, commit, start, machine), as ``--update`` keeps the workloads not run now.

A third workload, ``in_memory`` (issue 30 item 3), asks whether the documented function is fast
as called: ``gm.gradient_matching`` on ``--tasks`` diagonal tasks × ``--parameters`` float32
parameters held in memory (four tensors, prior δ = 1e-3), in three variants in the same process —
``reference`` (``kernel=None``: the chunked pass, which compiles nothing), ``default`` (no
``kernel=``: the kernel the streaming engine chooses) and ``fused_on`` (``kernel=Fused("on")``)
— each as a fraction of the memory-bandwidth roofline: the best of ``addcmul``/``add``/``copy_``
with ``out=`` over the same number of floats into touched memory (as ``merge.py``'s roofline),
against the (2 + 2T)·n·4 bytes Eq. 6 must move. Each round measures the roofline and the three
variants once, in turn, so that the load of the machine weighs on all alike; the figures are
medians over the rounds (after one warm-up round), fractions taken within each round. Bandwidths
are over the thread's CPU time (one torch thread), not wall time: on a machine whose cores other
jobs hold, a call's wall time is mostly waiting for a core (wall seconds are recorded beside).
The three outputs are compared bit for bit.

    python -m benchmarks.kernels --repeats 5 --blocks 1
    python -m benchmarks.kernels --workloads in_memory --repeats 9 --update
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

import gradmerge as gm
from benchmarks.merge import build_gpt2, make_flat
from benchmarks.record import (
    RecordError,
    Run,
    machine,
    read_result,
    run_measured,
    write_result,
)
from gradmerge.kernels import Fused, select

RESULTS = Path(__file__).resolve().parent / "results"

PRELUDE = {
    "c_loop": "",
    "torch_compile": (
        "from gradmerge.kernels import fused, native\n"
        "native.supports = lambda *args: False\n"
        "fused.MIN_NUMEL = native.MIN_NUMEL\n"
        "import os; os.environ['GRADMERGE_FUSED'] = 'on'\n"
    ),
}
"""Code run before the command in each variant's process."""


def command(variant: str, config: Path, out: Path) -> list[str]:
    code = (
        "import sys\n" + PRELUDE[variant] + "from gradmerge.cli import main\n"
        f"sys.exit(main(['merge', {str(config)!r}, {str(out)!r}, '--no-progress']))\n"
    )
    return [sys.executable, "-c", code]


def llama_blocks(folder: Path, blocks: int, tasks: int = 2) -> dict[str, Any]:
    """Base, ``tasks`` fine-tunes and their diagonal curvatures with Llama-7B's tensor shapes."""
    hidden, mlp = 4096, 11008
    shapes: dict[str, tuple[int, ...]] = {}
    for b in range(blocks):
        p = f"model.layers.{b}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}self_attn.{name}.weight"] = (hidden, hidden)
        shapes[f"{p}mlp.gate_proj.weight"] = (mlp, hidden)
        shapes[f"{p}mlp.up_proj.weight"] = (mlp, hidden)
        shapes[f"{p}mlp.down_proj.weight"] = (hidden, mlp)
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
    g = torch.Generator().manual_seed(0)
    base = {k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
    save_file(base, str(folder / "base.safetensors"))
    paths: dict[str, Any] = {"base": folder / "base.safetensors", "models": [], "curvatures": []}
    for t in range(tasks):
        ft = {k: v + 0.001 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        save_file(ft, str(folder / f"ft{t}.safetensors"))
        del ft
        h = {k: torch.rand(s, generator=g) for k, s in shapes.items()}
        paths["models"].append(folder / f"ft{t}.safetensors")
        paths["curvatures"].append(gm.Diagonal(h).save(folder / f"ft{t}.curvature.safetensors"))
        del h
    paths["parameters"] = sum(v.numel() for v in base.values())
    return paths


def config(folder: Path, paths: dict[str, Any], method: str) -> Path:
    spec: dict[str, Any] = {"method": method, "base_model": str(paths["base"])}
    if method == "task_arithmetic":
        spec["models"] = [{"model": str(m)} for m in paths["models"]]
    else:
        spec["models"] = [
            {"model": str(m), "curvature": str(c)}
            for m, c in zip(paths["models"], paths["curvatures"], strict=True)
        ]
        spec["prior"] = {"delta": 1e-3}
    path = folder / f"{method}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def compare(
    name: str, config_path: Path, folder: Path, repeats: int, parameters: int
) -> dict[str, Any]:
    """The two variants alternated; one untimed run of each first (warm caches)."""
    walls: dict[str, list[float]] = {v: [] for v in PRELUDE}
    loads: list[tuple[float, float]] = []
    outputs: dict[str, Path] = {}
    for i in range(repeats + 1):
        for variant in PRELUDE:
            out = folder / f"out-{variant}-{i}"
            before = os.getloadavg()[0]
            r = run_measured(command(variant, config_path, out))
            loads.append((before, os.getloadavg()[0]))
            if r["returncode"]:
                raise RuntimeError(f"{name} {variant} failed: {r.get('error')}")
            if i == 0:
                outputs[variant] = out  # the warm-up run's output is kept for the comparison
            else:
                walls[variant].append(r["wall_seconds"])
                shutil.rmtree(out)
            print(f"  {name} {variant:14s} round {i}: {r['wall_seconds']:.2f} s", flush=True)
    same = all(
        (outputs["c_loop"] / f.name).read_bytes() == f.read_bytes()
        for f in sorted(outputs["torch_compile"].glob("*.safetensors"))
    )
    for out in outputs.values():
        shutil.rmtree(out)
    med = {v: statistics.median(w) for v, w in walls.items()}
    ratios = [t / c for t, c in zip(walls["torch_compile"], walls["c_loop"], strict=True)]
    result = {
        "parameters": parameters,
        "repeats": repeats,
        "wall_seconds": walls,
        "median_wall_seconds": med,
        "torch_compile_over_c_loop_median": med["torch_compile"] / med["c_loop"],
        "torch_compile_over_c_loop_per_round": ratios,
        "outputs_identical": same,
        "load_average_1min_before_after": loads,
    }
    print(
        f"  {name}: C loop {med['c_loop']:.2f} s, torch.compile {med['torch_compile']:.2f} s "
        f"(median ratio {result['torch_compile_over_c_loop_median']:.3f}; per round "
        f"{', '.join(f'{x:.2f}' for x in ratios)}); identical outputs: {same}",
        flush=True,
    )
    return result


def in_memory(parameters: int, tasks: int, repeats: int) -> dict[str, Any]:
    """``gm.gradient_matching`` in memory: the chunked pass, the default and ``Fused("on")``
    against the roofline, interleaved round by round (module docstring)."""
    base, fts, hs = make_flat(parameters, tasks)
    curvatures = [gm.Diagonal(h) for h in hs]
    n = sum(v.numel() for v in base.values())
    nbytes = (2 + 2 * tasks) * n * 4  # θ_LLM, every θ_t and h_t read once, θ written once
    a, b, c, out = (torch.rand(n) for _ in range(4))
    roof = {  # bytes moved by each single-pass kernel over n floats, into touched memory
        "addcmul(a, b, c, out=)": (lambda: torch.addcmul(a, b, c, out=out), 4 * n * 4),
        "add(a, b, out=)": (lambda: torch.add(a, b, out=out), 3 * n * 4),
        "copy_": (lambda: out.copy_(a), 2 * n * 4),
    }

    def merged(**kernel: Any) -> dict[str, torch.Tensor]:
        return gm.gradient_matching(base, fts, curvatures, prior=1e-3, **kernel)

    variants = {
        "reference": lambda: merged(kernel=None),
        "default": lambda: merged(),
        "fused_on": lambda: merged(kernel=Fused("on")),
    }
    gbs: dict[str, list[float]] = {k: [] for k in [*roof, *variants]}
    wall: dict[str, list[float]] = {k: [] for k in [*roof, *variants]}
    loads: list[tuple[float, float]] = []
    outputs: dict[str, dict[str, torch.Tensor]] = {}

    def timed(name: str, fn: Callable[[], Any], moved: int) -> Any:
        """One call: GB/s over the thread's CPU time (preemption by the machine's other jobs
        left out; page faults and memory stalls counted), and its wall seconds."""
        gc.collect()
        start, cpu = time.perf_counter(), time.thread_time()
        value = fn()
        cpu, seconds = time.thread_time() - cpu, time.perf_counter() - start
        gbs[name].append(moved / cpu / 1e9)
        wall[name].append(seconds)
        return value

    for i in range(repeats + 1):  # round 0 warms up (builds the C loop, faults the pages in)
        before = os.getloadavg()[0]
        for name, (kernel, moved) in roof.items():
            timed(name, kernel, moved)
        for name, fn in variants.items():
            result = timed(name, fn, nbytes)
            if i == 0:
                outputs[name] = result
            del result
        loads.append((before, os.getloadavg()[0]))
    gbs = {k: v[1:] for k, v in gbs.items()}  # the warm-up round is not counted
    wall = {k: v[1:] for k, v in wall.items()}
    roofline = [max(r) for r in zip(*(gbs[k] for k in roof), strict=True)]
    fractions = {k: [x / r for x, r in zip(gbs[k], roofline, strict=True)] for k in variants}
    median = statistics.median
    result: dict[str, Any] = {
        "parameters": n,
        "tasks": tasks,
        "dtype": "float32",
        "prior": "δ·I, δ = 1e-3",
        "min_bytes_moved": nbytes,
        "repeats": repeats,
        "default_kernel": repr(select([v.numel() for v in base.values()])),
        "torch_threads": torch.get_num_threads(),
        "timing": "GB/s over the calling thread's CPU time (time.thread_time: one torch thread, "
        "the C loop unsplit), so that waiting for the loaded machine's cores is not counted; "
        "wall seconds beside it",
        "gb_per_s": gbs,
        "wall_seconds": wall,
        "roofline_gb_per_s": roofline,
        "median_roofline_gb_per_s": median(roofline),
        "median_fraction_of_roofline": {k: median(v) for k, v in fractions.items()},
        "median_default_over_fused_on": median(
            [d / f for d, f in zip(fractions["default"], fractions["fused_on"], strict=True)]
        ),
        "median_default_over_reference": median(
            [d / f for d, f in zip(fractions["default"], fractions["reference"], strict=True)]
        ),
        "outputs_identical": all(
            torch.equal(outputs["reference"][k], outputs[v][k])
            for v in ("default", "fused_on")
            for k in base
        ),
        "load_average_1min_before_after": loads,
    }
    f = result["median_fraction_of_roofline"]
    print(
        f"  in memory, {tasks} tasks × {n:,} parameters: roofline {median(roofline):.1f} GB/s; "
        f"fraction of it: reference {f['reference']:.2f}, default {f['default']:.2f} "
        f"({result['default_kernel']}), Fused('on') {f['fused_on']:.2f}; identical outputs: "
        f"{result['outputs_identical']}",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=1, help="Llama-7B decoder blocks")
    parser.add_argument("--workloads", nargs="+", default=["gpt2", "llama7b_blocks", "in_memory"])
    parser.add_argument("--parameters", type=int, default=32 * 2**20, help="in_memory: n")
    parser.add_argument("--tasks", type=int, default=4, help="in_memory: T")
    parser.add_argument("--out", type=Path, default=RESULTS / "kernels-cpu.json")
    parser.add_argument(
        "--update", action="store_true", help="keep the other workloads of an existing record"
    )
    args = parser.parse_args(argv)
    started = Run("kernels", settings=vars(args), argv=argv)
    run = {"command": started.command, "git": started.git, "started": started.started}
    run["machine"] = machine()
    workloads: dict[str, Any] = {}
    if args.update and args.out.is_file():  # the workloads not run now stay, with their run
        try:
            workloads = read_result(args.out)["results"]["workloads"]
        except RecordError as err:
            parser.error(f"--update keeps the workloads of a record: {err}; run every workload")
    if "in_memory" in args.workloads:
        name = f"in_memory gradient_matching, {args.tasks} diagonal tasks"
        workloads[name] = {"run": run, **in_memory(args.parameters, args.tasks, args.repeats)}
    with tempfile.TemporaryDirectory(dir=os.environ.get("GRADMERGE_BENCH_DIR")) as tmp:
        root = Path(tmp)
        if "gpt2" in args.workloads:
            folder = root / "gpt2"
            folder.mkdir()
            paths = build_gpt2(folder)
            for method in ("gradient_matching", "task_arithmetic"):
                name = f"gpt2-124m {method}"
                workloads[name] = {
                    "run": run,
                    **compare(
                        name,
                        config(folder, paths, method),
                        folder,
                        args.repeats,
                        paths["parameters"],
                    ),
                }
            shutil.rmtree(folder)
        if "llama7b_blocks" in args.workloads:
            folder = root / "llama"
            folder.mkdir()
            paths = llama_blocks(folder, args.blocks)
            name = f"llama-7b shapes, {args.blocks} block(s), gradient_matching"
            workloads[name] = {
                "run": run,
                **compare(
                    name,
                    config(folder, paths, "gradient_matching"),
                    folder,
                    args.repeats,
                    paths["parameters"],
                ),
            }
    write_result(args.out, started.finish({"workloads": workloads}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
