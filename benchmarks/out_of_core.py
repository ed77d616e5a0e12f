"""A merge whose inputs exceed the machine's RAM, through ``gradmerge merge``: peak resident memory
and wall time against reading every input once.

What it builds (random weights, nothing downloaded), in a fresh folder under ``--work``:
a base and ``--tasks`` fine-tunes with Llama-3.2-3B's tensor shapes (``--size 3b``: vocabulary
128,256, hidden 3,072, MLP 8,192, 28 layers, 24 query / 8 key-value heads of 128, tied
embeddings: 3.21B parameters), bfloat16, each a Hugging Face folder of 5 GB safetensors shards
with its index and ``config.json``; and one diagonal curvature file per fine-tune, bfloat16
(curvature files keep the dtype they are saved in and are merged in the compute dtype, so
bfloat16 halves their disk against float32). Every file is written a block of rows at a time
(``gradmerge.io.writer.ShardedWriter``), so building it needs no more memory than the merge.

What it runs, for ``gradient_matching`` (diagonal curvatures, ``prior: {delta: 1e-3}``: reads
base, fine-tunes and curvatures) and ``task_arithmetic`` (reads base and fine-tunes), each:

1. the inputs are evicted from the page cache (``posix_fadvise(DONTNEED)`` on each file, after
   they were synced; ``/proc/sys/vm/drop_caches`` needs privileges this benchmark does not
   ask for), and the share of their pages still cached is measured (``mincore``);
2. **read once**: every input file is read sequentially with 16 MiB ``readinto`` calls — the
   least I/O any merge of these inputs must do;
3. the inputs are evicted again, and ``python -m gradmerge merge CONFIG OUT --no-progress``
   runs in a fresh process while a thread samples its ``/proc/PID/status`` every 10 ms:
   ``RssAnon`` (anonymous resident memory: heap, tensors, the outputs' buffers — **the
   measure of the merge's footprint**), ``RssFile`` (resident pages of mapped files: the
   memory-mapped inputs, which the kernel drops under pressure, so they are page cache, not
   the merge's footprint), and at the end ``VmHWM`` (the kernel's own peak of RssAnon + RssFile
   + RssShmem, which therefore counts mapped page cache). Peak RssAnon is also reported above an
   idle ``python -c "import gradmerge.cli"`` (the interpreter and torch) measured the same way.
   The output is checked: every tensor present, and a sample of tensors (every norm, the first
   and last layers' projections, the embedding's first and last rows) equal to the ``gm.*``
   rule applied in memory to the same inputs, bit for bit. The merge's CPU time (user +
   system, ``getrusage`` of the child) is recorded beside its wall time;
4. the inputs are evicted and read once more, after the merge, the same way: on a shared
   machine the disk's speed drifts, so the wall is given against both reads. The load average
   is recorded at each phase (each merge's ``load_average``).

Targets: peak RssAnon ≤ 1 GiB; merge wall ≤ 1.5× the read-once time.

Disk: the free space is checked first; the run refuses to start if it would leave less than
``--min-free-gb`` free (10 GB; 0.5 GB for ``--size tiny``, which writes a few MB), and removes
everything it generated at the end, on failure and on SIGINT/SIGTERM (``--keep`` keeps the inputs).

    python -m benchmarks.out_of_core                       # 3B-class, writes results/out-of-core-cpu.json
    python -m benchmarks.out_of_core --size tiny --out /tmp/ooc.json   # seconds (the test's run)
    python -m benchmarks.out_of_core --layers 14           # fewer decoder layers, same shapes
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import json
import math
import mmap
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from benchmarks.record import Run, machine, write_result

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "out-of-core-cpu.json"
GiB, GB = 1024**3, 10**9
DELTA = 1e-3  # the prior δ of the gradient-matching merge
BLOCK_ELEMENTS = 1 << 24  # elements generated and written at a time
SAMPLE_SECONDS = 0.01


@dataclass(frozen=True)
class Shapes:
    """A Llama-style decoder's tensor shapes (``tied``: no separate ``lm_head``)."""

    vocab: int
    hidden: int
    mlp: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = True

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Name → shape, in the order a Hugging Face Llama checkpoint stores them."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}"
            out |= {
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.self_attn.q_proj.weight": (q, h),
                f"{p}.self_attn.k_proj.weight": (kv, h),
                f"{p}.self_attn.v_proj.weight": (kv, h),
                f"{p}.self_attn.o_proj.weight": (h, q),
                f"{p}.post_attention_layernorm.weight": (h,),
                f"{p}.mlp.gate_proj.weight": (self.mlp, h),
                f"{p}.mlp.up_proj.weight": (self.mlp, h),
                f"{p}.mlp.down_proj.weight": (h, self.mlp),
            }
        out["model.norm.weight"] = (h,)
        if not self.tied:
            out["lm_head.weight"] = (self.vocab, h)
        return out

    def parameters(self) -> int:
        return sum(math.prod(s) for s in self.tensors().values())

    def config(self) -> dict[str, Any]:
        """A ``config.json`` of this shape (what transformers' LlamaConfig reads)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.mlp,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "tie_word_embeddings": self.tied,
            "torch_dtype": "bfloat16",
        }


SIZES = {
    "3b": Shapes(128_256, 3072, 8192, 28, 24, 8, 128),  # Llama-3.2-3B's shapes
    "tiny": Shapes(512, 64, 172, 2, 4, 2, 16),
}
MIN_FREE_GB = {"3b": 10.0, "tiny": 0.5}
"""Free space each size's run must leave, by default (``--min-free-gb`` overrides)."""


# ----- building the inputs: one block of rows at a time ------------------------------------------
def _blocks(shape: tuple[int, ...]) -> Iterator[slice]:
    rows, row = (shape[0] if shape else 1), math.prod(shape[1:])
    if row > BLOCK_ELEMENTS:
        raise ValueError(f"rows of {row} values are longer than a block ({BLOCK_ELEMENTS})")
    step = max(1, BLOCK_ELEMENTS // max(1, row))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


POOL = 1 << 25
"""Random values per input, from which every block is cut at its own offset: generating 3·10⁹
normal deviates per input would take longer than writing them (and the merge's speed does not
depend on the values)."""


@functools.cache
def _pool(kind: str, task: int) -> torch.Tensor:
    """The values an input's blocks are cut from: the base's weights, a fine-tune's (the base's
    pool plus a small task vector, so that each fine-tune is the base plus a step at every
    offset), a curvature's positive diagonal."""
    g = torch.Generator().manual_seed(_seed(kind, task))
    if kind == "curvature":
        return (torch.rand(POOL, generator=g) * 10 + 0.1).to(torch.bfloat16)
    if kind == "base":
        return (torch.randn(POOL, generator=g) * 0.02).to(torch.bfloat16)
    step = torch.randn(POOL, generator=g) * 1e-3
    return (_pool("base", -1).float() + step).to(torch.bfloat16)


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


def _block(kind: str, task: int, name: str, rows: slice, shape: tuple[int, ...]) -> torch.Tensor:
    """Rows ``rows`` of tensor ``name`` of an input: a slice of its pool at an offset set by
    (name, first row), the same for every input, so fine-tune = base + step elementwise."""
    part = (rows.stop - rows.start, *shape[1:]) if shape else ()
    n = math.prod(part)
    offset = _seed(name, rows.start) % (POOL - n + 1)
    return _pool(kind, task)[offset : offset + n].view(part)


def write_input(folder: Path, kind: str, task: int, shapes: Shapes) -> list[Path]:
    """Write one input: a Hugging Face folder (``base``, ``model``) or a curvature file."""
    from gradmerge.curvature.io import FORMAT, fingerprint
    from gradmerge.io.writer import ShardedWriter

    tensors = shapes.tensors()
    folder.mkdir(parents=True)
    if kind == "curvature":
        layout = [[k, list(s)] for k, s in tensors.items()]
        meta = {  # the curvature file format of docs/architecture.md, for a Diagonal
            "format": FORMAT,
            "structure": "diag",
            "spec": json.dumps({"type": "diag", "keys": list(tensors)}),
            "layout": json.dumps(layout),
            "fingerprint": fingerprint([(k, torch.Size(s)) for k, s in tensors.items()]),
            "dtype": "bfloat16",
            "precision": "bfloat16",
            "info.reduction": "sum",
        }
        entries = [(f"diag/{k}", s, torch.bfloat16) for k, s in tensors.items()]
        writer = ShardedWriter(folder, entries, 1 << 62, metadata=meta)
        names = [f"diag/{k}" for k in tensors]
    else:
        entries = [(k, s, torch.bfloat16) for k, s in tensors.items()]
        writer = ShardedWriter(folder, entries, 5 * GB)
        names = list(tensors)
        (folder / "config.json").write_text(json.dumps(shapes.config(), indent=2) + "\n")
    for name, (key, shape) in zip(names, tensors.items(), strict=True):
        if not shape:
            writer.write(name, _block(kind, task, key, slice(0, 1), shape))
            continue
        for rows in _blocks(shape):
            writer.write_rows(name, _block(kind, task, key, rows, shape), rows.start)
    files = writer.finish()
    _pool.cache_clear()
    if kind == "curvature":  # one file, named as a curvature file
        target = folder.parent / f"{folder.name}.safetensors"
        os.replace(files[0], target)
        folder.rmdir()
        files = [target]
    for f in files:
        _sync(f)
    return files


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----- the page cache ----------------------------------------------------------------------------
def evict(files: list[Path]) -> None:
    """Drop the files' clean pages from the page cache (they were synced when written)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(files: list[Path]) -> float:
    """The share of the files' pages in the page cache (``mincore`` over a private mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page, resident, total = mmap.PAGESIZE, 0, 0
    for f in files:
        size = f.stat().st_size
        if size == 0:
            continue
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            buf = (ctypes.c_char * size).from_buffer(mm)
            try:
                if libc.mincore(ctypes.addressof(buf), size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore failed on {f}")
                resident += sum(v & 1 for v in bytes(vec))
            finally:
                del buf
            total += pages
    return resident / total if total else 0.0


def read_once(files: list[Path]) -> dict[str, Any]:
    """Read every file once, sequentially, with 16 MiB reads: the least I/O of a merge."""
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    nbytes, start = 0, time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                nbytes += n
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes": nbytes, "gib_per_second": nbytes / GiB / seconds}


# ----- one process, sampled ----------------------------------------------------------------------
def measured(cmd: list[str]) -> dict[str, Any]:
    """Run ``cmd``; sample its /proc status every 10 ms: peak RssAnon and RssFile, last VmHWM."""
    from benchmarks.merge import proc_status

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0, "VmHWM": 0}
    samples = [0]

    def sample() -> None:
        while proc.poll() is None:
            status = proc_status(proc.pid)
            for k in peak:
                peak[k] = max(peak[k], status.get(k, 0))
            samples[0] += 1
            time.sleep(SAMPLE_SECONDS)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    stdout, stderr = proc.communicate()
    thread.join()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "wall_seconds": wall,
        "cpu_seconds": cpu,  # user + system time of the process (its threads together)
        "returncode": proc.returncode,
        "peak_rss_anon_bytes": peak["RssAnon"],
        "peak_rss_file_bytes": peak["RssFile"],
        "peak_vm_rss_bytes": peak["VmRSS"],
        "vm_hwm_bytes": peak["VmHWM"],
        "samples": samples[0],
        "tail": (stdout + stderr)[-1500:],
    }


# ----- checking the output ------------------------------------------------------------------------
def sample(shapes: Shapes, full: bool) -> list[tuple[str, slice | None]]:
    """What is compared with the in-memory rule: every tensor (``full``), or every norm, the
    first and last layers' tensors and the embedding's first and last 8 rows."""
    if full:
        return [(k, None) for k in shapes.tensors()]
    last = shapes.layers - 1
    layers = ("model.layers.0.", f"model.layers.{last}.")
    keys = [k for k in shapes.tensors() if "norm" in k or k.startswith(layers)]
    return [(k, None) for k in keys] + [
        ("model.embed_tokens.weight", slice(0, 8)),
        ("model.embed_tokens.weight", slice(shapes.vocab - 8, shapes.vocab)),
    ]


def check_output(out: Path, config: dict[str, Any], shapes: Shapes, full: bool) -> dict[str, Any]:
    """Every tensor present with its shape and dtype; the sampled tensors (every tensor when
    ``full``) equal to the gm.* rule applied in memory to the same inputs, bit for bit."""
    import gradmerge as gm
    from gradmerge.curvature.io import open_curvature
    from gradmerge.io import open_checkpoint

    tensors, f32 = shapes.tensors(), torch.float32
    pieces = sample(shapes, full)
    alphas = [m.get("alpha", 1.0) for m in config["models"]]
    with ExitStack() as stack:
        merged = stack.enter_context(open_checkpoint(out))
        base = stack.enter_context(open_checkpoint(config["base_model"]))
        models = [stack.enter_context(open_checkpoint(m["model"])) for m in config["models"]]
        curvatures = [
            stack.enter_context(open_curvature(m["curvature"]))
            for m in config["models"]
            if "curvature" in m
        ]
        wrong = [
            k
            for k in tensors
            if k not in merged or merged.shape(k) != tensors[k] or merged.dtype(k) != torch.bfloat16
        ]
        differing = []
        for k, rows in pieces:
            b = {k: base.get(k, dtype=f32, rows=rows)}
            fts = [{k: m.get(k, dtype=f32, rows=rows)} for m in models]
            if config["method"] == "task_arithmetic":
                expected = gm.task_arithmetic(b, fts, alphas=alphas)[k]
            else:
                hs = [c.restrict([k], dtype=f32, rows=rows) for c in curvatures]
                expected = gm.gradient_matching(b, fts, hs, prior=DELTA, alphas=alphas)[k]
            if not torch.equal(merged.get(k, rows=rows), expected.to(torch.bfloat16)):
                differing.append(k if rows is None else f"{k}[{rows.start}:{rows.stop}]")
    return {
        "tensors": len(tensors),
        "compared": [k if r is None else f"{k}[{r.start}:{r.stop}]" for k, r in pieces],
        "differing": differing,
        "missing_or_wrong_shape_or_dtype": wrong,
        "ok": not differing and not wrong,
    }


# ----- the run ------------------------------------------------------------------------------------
def gradmerge_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "gradmerge", *args]


def disk_need(shapes: Shapes, tasks: int) -> int:
    """Bytes the run writes at most at once: 1 + 2·tasks inputs and one output."""
    return (2 + 2 * tasks) * shapes.parameters() * 2


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The measurements (a record's ``results``); the machine and the load before and after are
    the record's."""
    shapes = SIZES[args.size]
    if args.layers is not None:
        shapes = replace(shapes, layers=args.layers)
    ram = machine()["memory_bytes"]
    work_root = Path(args.work).absolute()
    work_root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work_root).free
    need = disk_need(shapes, args.tasks)
    if free - need < args.min_free_gb * GB:
        raise SystemExit(
            f"refusing to start: {free / GB:.1f} GB free on {work_root}, the run writes up to "
            f"{need / GB:.1f} GB and must leave {args.min_free_gb} GB free; free space, choose "
            "--work on another disk, or pass fewer --layers"
        )
    report: dict[str, Any] = {
        "size": args.size,
        "shapes": asdict(shapes),
        "parameters": shapes.parameters(),
        "tasks": args.tasks,
        "disk": {"work": str(work_root), "free_before_bytes": free, "need_bytes": need},
        "sample_seconds": SAMPLE_SECONDS,
    }
    work = Path(tempfile.mkdtemp(prefix="out-of-core-", dir=work_root))
    print(f"work folder {work} ({shapes.parameters() / 1e9:.2f}B parameters per model)", flush=True)
    try:
        report |= _run_in(work, shapes, args, ram)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        report["disk"]["removed"] = not work.exists()
    return report


def _run_in(work: Path, shapes: Shapes, args: argparse.Namespace, ram: int) -> dict[str, Any]:
    start = time.perf_counter()
    inputs: dict[str, list[Path]] = {"base": write_input(work / "base", "base", -1, shapes)}
    for t in range(args.tasks):
        inputs[f"ft{t}"] = write_input(work / f"ft{t}", "model", t, shapes)
        inputs[f"c{t}"] = write_input(work / f"ft{t}.curvature", "curvature", t, shapes)
        print(f"  wrote inputs of task {t} ({time.perf_counter() - start:.0f} s)", flush=True)
    build = time.perf_counter() - start
    written = sum(f.stat().st_size for fs in inputs.values() for f in fs)
    result: dict[str, Any] = {
        "build": {"seconds": build, "bytes": written, "gib_per_second": written / GiB / build},
        "idle_process": measured([sys.executable, "-c", "import gradmerge.cli"]),
        "merges": {},
    }
    models = [{"model": str(work / f"ft{t}"), "alpha": 1.0} for t in range(args.tasks)]
    configs = {
        "gradient_matching": {
            "method": "gradient_matching",
            "base_model": str(work / "base"),
            "models": [
                m | {"curvature": str(work / f"ft{t}.curvature.safetensors")}
                for t, m in enumerate(models)
            ],
            "prior": {"delta": DELTA},
        },
        "task_arithmetic": {
            "method": "task_arithmetic",
            "base_model": str(work / "base"),
            "models": models,
        },
    }
    for method in args.methods:
        config = configs[method]
        read = [k for k in inputs if method == "gradient_matching" or not k.startswith("c")]
        files = [f for k in read for f in inputs[k] if f.suffix == ".safetensors"]
        nbytes = sum(f.stat().st_size for f in files)
        yaml_path = work / f"{method}.yaml"
        yaml_path.write_text(yaml.safe_dump(config))
        out = work / f"{method}-out"
        load = {"before_read": os.getloadavg()}
        evict(files)
        cold_read = cached_fraction(files)
        baseline = read_once(files)
        evict(files)
        cold_merge = cached_fraction(files)
        load["before_merge"] = os.getloadavg()
        merge = measured(gradmerge_cmd("merge", str(yaml_path), str(out), "--no-progress"))
        load["after_merge"] = os.getloadavg()
        if merge["returncode"] != 0:
            raise RuntimeError(f"gradmerge merge failed: {merge['tail']}")
        evict(files)  # the same read again, after the merge: the disk's speed may drift
        cold_after = cached_fraction(files)
        after = read_once(files)
        load["after_second_read"] = os.getloadavg()
        record = json.loads((out / "gradmerge_merge.json").read_text())
        check = check_output(out, config, shapes, full=args.size == "tiny")
        out_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        shutil.rmtree(out)
        row = {
            "input_files": len(files),
            "input_bytes": nbytes,
            "inputs_over_ram": nbytes / ram,
            "output_bytes": out_bytes,
            "cached_fraction_before_read": cold_read,
            "cached_fraction_before_merge": cold_merge,
            "read_once": baseline,
            "cached_fraction_before_second_read": cold_after,
            "read_once_after_merge": after,
            "load_average": load,  # 1, 5 and 15 min, at each phase's start or end
            "merge": merge,
            "merge_record_seconds": record.get("seconds"),
            "wall_over_read_once": merge["wall_seconds"] / baseline["seconds"],
            "wall_over_read_once_after_merge": merge["wall_seconds"] / after["seconds"],
            "peak_rss_anon_gib": merge["peak_rss_anon_bytes"] / GiB,
            "peak_rss_anon_above_idle_gib": (
                merge["peak_rss_anon_bytes"] - result["idle_process"]["peak_rss_anon_bytes"]
            )
            / GiB,
            "check": check,
            "targets": {
                "peak_rss_anon_le_1gib": merge["peak_rss_anon_bytes"] <= GiB,
                "wall_le_1.5x_read_once": merge["wall_seconds"] <= 1.5 * baseline["seconds"],
            },
        }
        result["merges"][method] = row
        print(
            f"  {method}: inputs {nbytes / GiB:.1f} GiB ({nbytes / ram:.2f}× RAM), read once "
            f"{baseline['seconds']:.1f} s (after: {after['seconds']:.1f} s), merge "
            f"{merge['wall_seconds']:.1f} s ({row['wall_over_read_once']:.2f}×, CPU "
            f"{merge['cpu_seconds']:.0f} s, load {load['before_merge'][0]:.1f}), peak RssAnon {row['peak_rss_anon_gib']:.2f} GiB, "
            f"VmHWM {merge['vm_hwm_bytes'] / GiB:.1f} GiB, output equal: {check['ok']}",
            flush=True,
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="3b")
    parser.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default: the size's)"
    )
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=["gradient_matching", "task_arithmetic"],
        default=["gradient_matching", "task_arithmetic"],
    )
    parser.add_argument("--work", default=tempfile.gettempdir(), help="where the inputs go")
    parser.add_argument(
        "--min-free-gb",
        type=float,
        default=None,
        help="free space the run must leave (default: "
        + ", ".join(f"{gb:g} GB for --size {size}" for size, gb in MIN_FREE_GB.items())
        + ")",
    )
    parser.add_argument("--keep", action="store_true", help="keep the generated inputs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.min_free_gb is None:
        args.min_free_gb = MIN_FREE_GB[args.size]
    full = args.size == "3b" and args.layers is None
    name = f"out-of-core-{args.size}{'' if args.layers is None else f'-{args.layers}layers'}.json"
    out = args.out or (RESULT if full else RESULT.with_name(name))

    def stop(signum: int, _frame: object) -> None:  # cleanup runs in run()'s finally
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    started = Run("out_of_core", settings=vars(args), argv=argv)
    report = run(args)
    write_result(out, started.finish(report))
    ok = all(r["check"]["ok"] for r in report["merges"].values())
    print(f"wrote {out}; outputs equal to the in-memory rule: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
