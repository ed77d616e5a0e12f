"""Does the generated C loop earn its place? End-to-end streamed diagonal merges, C loop against
``torch.compile``, interleaved.

The question: the fast diagonal path of the streaming engine (``gradmerge.kernels``) builds a C
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

A third workload, ``in_memory``, asks whether the documented function is fast as
called: ``gm.gradient_matching`` on ``--tasks`` diagonal tasks × ``--parameters`` float32
parameters held in memory (four tensors, prior δ = 1e-3), in four variants in the same process —
``reference`` (``kernel=None``: the chunked pass, which compiles nothing), ``default`` (no
``kernel=``: the kernel the streaming engine chooses), ``fused_on`` (``kernel=Fused("on")``) and
``default_1_thread`` (the default with torch's threads set to 1 for the call) — against the
(2 + 2T)·n·4 bytes Eq. 6 must move. Two rooflines, both at the machine's streaming bandwidth: the
best of ``addcmul``/``add``/``copy_`` with ``out=`` over n floats into touched memory, over all
rounds (a stream kernel that the machine's other jobs preempt runs slower, never faster).
``touched`` moves all the bytes at that bandwidth, as if the output existed already;
``fresh_output`` (the fair one: a user's call returns new tensors) writes a fresh output of the
merge's sizes by ``copy_`` — the fastest over the rounds of ``torch.empty`` and
``gradmerge.kernels.memory.empty``, allocation and page faults included — and moves the other bytes
at that bandwidth. Every round runs each stream kernel, fresh-output copy and variant once, in an
order shuffled anew each round (seeded: what ran just before a call — which memory it freed, how —
changes the call's page faults, so no job may always follow the same one); wall seconds, under
torch's threads as a user's call runs them (so run it at normal priority and read the load recorded
beside); a variant's fraction of a roofline is taken per round and reported as median, quartiles
and range over the rounds, after two uncounted warm-up rounds. The first of those counts the
tensors each variant hands to the C loop (which path ran, seen rather than assumed) and keeps the
outputs, compared bit for bit.

    python -m benchmarks.kernels --repeats 5 --blocks 1
    python -m benchmarks.kernels --workloads in_memory --repeats 15 --update
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

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
from gradmerge.kernels import Fused, memory, native, select

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


def in_memory(parameters: int, tasks: int, repeats: int, warmups: int = 2) -> dict[str, Any]:
    """``gm.gradient_matching`` in memory: the chunked pass, the default and ``Fused("on")``
    against the roofline, interleaved round by round (module docstring)."""
    base, fts, hs = make_flat(parameters, tasks)
    curvatures = [gm.Diagonal(h) for h in hs]
    n = sum(v.numel() for v in base.values())
    nbytes = (2 + 2 * tasks) * n * 4  # θ_LLM, every θ_t and h_t read once, θ written once
    a, b, c, out = (torch.rand(n) for _ in range(4))
    stream = {  # bytes moved by each single-pass kernel over n floats, into touched memory
        "addcmul(a, b, c, out=)": (lambda: torch.addcmul(a, b, c, out=out), 4 * n * 4),
        "add(a, b, out=)": (lambda: torch.add(a, b, out=out), 3 * n * 4),
        "copy_": (lambda: out.copy_(a), 2 * n * 4),
    }

    def copied(allocate: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        return [allocate(v).copy_(v) for v in base.values()]

    fresh = {  # outputs of the merge's sizes, fresh (allocated, faulted in) and written once
        "torch.empty + copy_": lambda: copied(torch.empty_like),
        "memory.empty + copy_": lambda: copied(lambda v: memory.empty(v.shape, like=v)),
    }

    def merged(**kernel: Any) -> dict[str, torch.Tensor]:
        return gm.gradient_matching(base, fts, curvatures, prior=1e-3, **kernel)

    def one_thread() -> dict[str, torch.Tensor]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return merged()
        finally:
            torch.set_num_threads(threads)

    variants = {
        "reference": lambda: merged(kernel=None),
        "default": lambda: merged(),
        "fused_on": lambda: merged(kernel=Fused("on")),
        "default_1_thread": one_thread,
    }
    jobs: dict[str, Callable[[], Any]] = {
        **{k: fn for k, (fn, _) in stream.items()},
        **fresh,
        **variants,
    }
    seconds: dict[str, list[float]] = {k: [] for k in jobs}
    loads: list[tuple[float, float]] = []
    outputs: dict[str, dict[str, torch.Tensor]] = {}
    c_loop: dict[str, int] = {}  # tensors the C loop merged, per variant (in the first round)
    shuffle = random.Random(0)
    for i in range(warmups + repeats):
        order = list(jobs)
        shuffle.shuffle(order)  # no job always follows the same one (what ran before matters)
        before = os.getloadavg()[0]
        for name in order:
            # which path each variant runs, seen: the C loop's calls counted in the first round
            spy = mock.patch.object(native, "merge_tensor", wraps=native.merge_tensor)
            with spy if i == 0 else contextlib.nullcontext(None) as seen:
                gc.collect()
                start = time.perf_counter()
                value = jobs[name]()
                seconds[name].append(time.perf_counter() - start)
            if seen is not None and name in variants:
                outputs[name], c_loop[name] = value, seen.call_count
            del value
        loads.append((before, os.getloadavg()[0]))
    seconds = {k: v[warmups:] for k, v in seconds.items()}
    rounds = range(repeats)
    bandwidth = [max(moved / seconds[k][r] for k, (_, moved) in stream.items()) for r in rounds]
    fresh_output = [min(seconds[k][r] for k in fresh) for r in rounds]
    peak, fastest_output = max(bandwidth), min(fresh_output)  # the machine undisturbed
    roofline = {  # seconds the merge's bytes take at the streaming bandwidth
        "touched": nbytes / peak,
        "fresh_output": fastest_output + (nbytes - 2 * n * 4) / peak,
    }
    first_touch = [seconds["memory.empty + copy_"][r] - seconds["copy_"][r] for r in rounds]

    def spread(values: list[float]) -> dict[str, float]:
        q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
        return {"median": q[1], "q1": q[0], "q3": q[2], "min": min(values), "max": max(values)}

    fractions = {
        kind: {k: spread([roof / seconds[k][r] for r in rounds]) for k in variants}
        for kind, roof in roofline.items()
    }
    result: dict[str, Any] = {
        "parameters": n,
        "tensors": len(base),
        "tasks": tasks,
        "dtype": "float32",
        "prior": "δ·I, δ = 1e-3",
        "min_bytes_moved": nbytes,
        "repeats": repeats,
        "warmup_rounds": warmups,
        "default_kernel": repr(select([v.numel() for v in base.values()])),
        "tensors_merged_by_the_c_loop": c_loop,
        "torch_threads": torch.get_num_threads(),
        "nice": os.nice(0),
        "timing": "wall seconds of each call (torch's threads, as a user's call runs), every job "
        "once per round in an order shuffled each round (seed 0); a variant's fraction of a "
        "roofline per round, as median, quartiles and range over the rounds",
        "definitions": {
            "streaming bandwidth": "the best of the stream kernels over all rounds (into "
            "touched memory): the machine's, undisturbed by its other jobs",
            "roofline touched": "min_bytes_moved at the streaming bandwidth",
            "roofline fresh_output": "the fastest fresh output of the merge's sizes written by "
            "copy_ over all rounds (torch.empty, what any torch call returning new tensors "
            "allocates, or gradmerge.kernels.memory.empty, what the merge allocates), plus the "
            "other min_bytes_moved − 2·n·4 bytes at the streaming bandwidth",
            "output_first_touch_seconds": "memory.empty + copy_ less copy_ into touched "
            "memory: what allocating and faulting in the merge's fresh outputs adds",
        },
        "seconds": seconds,
        "streaming_gb_per_s_per_round": spread([x / 1e9 for x in bandwidth]),
        "streaming_gb_per_s": peak / 1e9,
        "roofline_seconds": roofline,
        "output_first_touch_seconds": spread(first_touch),
        "fraction_of_roofline": fractions,
        "median_seconds": {k: statistics.median(v) for k, v in seconds.items()},
        "outputs_identical": all(
            torch.equal(outputs["reference"][k], outputs[v][k]) for v in variants for k in base
        ),
        "load_average_1min_before_after": loads,
    }
    f = {k: v["median"] for k, v in fractions["fresh_output"].items()}
    print(
        f"  in memory, {tasks} tasks × {n:,} parameters, {result['torch_threads']} threads: "
        f"streaming {peak / 1e9:.1f} GB/s; median fraction of the "
        f"roofline (fresh output): reference {f['reference']:.2f}, default {f['default']:.2f} "
        f"({result['default_kernel']}), Fused('on') {f['fused_on']:.2f}, default on 1 thread "
        f"{f['default_1_thread']:.2f} (touched memory: default "
        f"{fractions['touched']['default']['median']:.2f}); output first touch "
        f"{statistics.median(first_touch):.3f} s; identical outputs: "
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
