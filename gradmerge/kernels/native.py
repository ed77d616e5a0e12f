"""Eq. 6 for elementwise curvatures as one C loop, built by the system C compiler and cached.

The CPU backend of :mod:`gradmerge.kernels.fused`: for float32 and float64 tensors on a CPU it
writes, for each *pattern* (the number of tasks T and whether each of H_0, H_1..H_T is δ·I, a tensor
h_i, or an :class:`Affine` tensor c_i·s_i + δ_i formed in the loop), a C function whose loop reads
θ_LLM, every θ_t and h_t (or c_t) once and writes θ once,

.. math::

    \\bar h = (h_0 + \\alpha_1 h_1) + \\alpha_2 h_2 + \\dots, \\qquad
    \\theta = \\theta_{LLM} + \\Big(\\sum_t \\alpha_t (h_0 \\tau_t + h_t \\tau_t)\\Big) / \\bar h,
    \\quad \\tau_t = \\theta_t - \\theta_{LLM},

with every operation rounded once to the tensors' type in the chunked path's order
(``-ffp-contract=off``: no fused multiply-adds; ``FLT_EVAL_METHOD == 0`` is required), so the
result is bit-identical to :mod:`gradmerge.elementwise.matching` and the operator algebra. An affine
h_i = (c_i·s_i) + δ_i (a prior δ·I + s·C, :meth:`gradmerge.Diagonal.shifted`) is rounded as the
operator algebra rounds it, so it is never written to memory. The same loop counts the elements
where θ is not finite, H̄ ≤ 0 or some h < 0; a count above zero sends the tensor back to the
chunked path for the exact diagnosis. A tensor of at least :data:`PARALLEL_MIN_NUMEL` elements
per thread is cut into :data:`PIECES_PER_THREAD` pieces per thread of ``torch.get_num_threads()``,
which the calling thread and its helpers take in turn (the ctypes call releases the GIL; each
element is computed alone, so the split changes nothing): on a machine whose cores other jobs
share, a helper that wakes late or is preempted holds back one piece, not half the tensor. From
:data:`STREAM_MIN_NUMEL` elements θ is written with non-temporal stores on x86 (computed into an
aligned block of 64 elements, then streamed out), which spares reading each output line before
writing it.

bfloat16 tensors (:data:`WIDENED`) are read and written as stored while the loop computes in
float32: each value is widened in registers (exactly: a bfloat16 is the top half of a float32)
and θ is rounded to nearest even as ``.to(torch.bfloat16)`` rounds it, so the result is bit for
bit the float32 loop's on the widened tensors, rounded; a θ that rounds to ±Inf counts as
uncertified, in the same loop (:data:`BF16_HELPERS`).

Each pattern is built once per machine (measured in ``benchmarks/README.md``): the library is kept
in ``$GRADMERGE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/gradmerge`` or ``~/.cache/gradmerge``), under
a name hashing the source, the compiler, its flags and the CPU; a folder that is not private to
this user is not trusted (a fresh private temporary folder is used instead). The compiler is
``$CC`` or ``cc``.

Example:
    >>> import torch
    >>> b, f = torch.zeros(5), torch.ones(5)
    >>> out = merge_tensor(b, [f], [1.0], [1.0, torch.full((5,), 3.0)])
    >>> out is None or out.tolist() == [1.0] * 5   # None where no C compiler is installed
    True
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import queue
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from gradmerge.elementwise.matching import Affine, H, tensors
from gradmerge.kernels import memory

MIN_NUMEL = 1 << 12
"""Tensors from this many elements on take the C loop (below, the call costs more than it saves)."""

PARALLEL_MIN_NUMEL = 1 << 18
"""Elements per thread from which a tensor's loop is split over ``torch.get_num_threads()``
threads (the result does not depend on the split: each element is computed alone)."""

STREAM_MIN_NUMEL = 1 << 18
"""Elements per call from which the loop writes θ with non-temporal (streaming) stores, on x86
CPUs: an output this large outlives the caches anyway, and streaming stores spare the read of
each output line before its write (one stream of the 2 + 2T the loop moves). Below, ordinary
stores leave a small output in cache for whoever reads it next."""

STREAM_HELPERS = (
    "#if defined(__SSE2__)",
    "#include <immintrin.h>",
    "#define GM_STREAM 1",
    "#define GM_ALIGN 64 /* bytes: a cache line, and every vector's alignment */",
    "#define GM_BLOCK 64 /* elements computed into tmp, then streamed out */",
    "static inline void gm_stream(void *restrict dst, const void *restrict src, size_t bytes) {",
    "  char *d = (char *)dst;",
    "  const char *s = (const char *)src;",
    "#if defined(__AVX512F__)",
    "  for (size_t j = 0; j < bytes; j += 64)",
    "    _mm512_stream_si512((void *)(d + j), _mm512_load_si512((const void *)(s + j)));",
    "#elif defined(__AVX__)",
    "  for (size_t j = 0; j < bytes; j += 32)",
    "    _mm256_stream_si256((__m256i *)(d + j), _mm256_load_si256((const __m256i *)(s + j)));",
    "#else",
    "  for (size_t j = 0; j < bytes; j += 16)",
    "    _mm_stream_si128((__m128i *)(d + j), _mm_load_si128((const __m128i *)(s + j)));",
    "#endif",
    "}",
    "#else",
    "#define GM_STREAM 0",
    "#endif",
)
"""C lines before the loop: :func:`gm_stream` copies a block of θ from an aligned buffer to
``out`` with non-temporal stores where the CPU has them (x86 from SSE2; elsewhere
``GM_STREAM`` is 0 and every element is stored directly)."""

PIECES_PER_THREAD = 4
"""A split tensor is cut into this many pieces per thread, which the threads take in turn: a
thread the machine's other jobs preempt holds back one piece, not its whole share."""

DTYPES = {torch.float32: "float", torch.float64: "double"}
WIDENED = {torch.bfloat16: "float"}
"""Stored dtypes the loop reads and writes while computing in a wider C type: a bfloat16 is the
top half of a float32, so it is widened exactly in registers, and θ is rounded back to nearest
even as torch's ``.to(torch.bfloat16)`` rounds it (:data:`BF16_HELPERS`)."""

BF16_HELPERS = (
    "#include <string.h>",
    "static inline float gm_load(uint16_t x) { /* exact: the top half of a float32 */",
    "  const uint32_t u = (uint32_t)x << 16;",
    "  float f;",
    "  memcpy(&f, &u, sizeof f);",
    "  return f;",
    "}",
    "static inline uint16_t gm_store(float f) { /* to nearest even, as torch rounds */",
    "  uint32_t u;",
    "  memcpy(&u, &f, sizeof u);",
    "  if (f != f) return (uint16_t)0x7FC0;",
    "  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);",
    "}",
    "#define GM_OVERFLOW(o) (((o) & 0x7F80u) == 0x7F80u) /* rounded to Inf (or NaN) */",
)
"""C lines of a loop over bfloat16 tensors: :func:`gm_load` widens a stored value, :func:`gm_store`
rounds θ (a NaN gives the quiet NaN 0x7FC0; NaN results are refused anyway) and
``GM_OVERFLOW`` tests the stored result, so a finite float32 θ that rounds to ±Inf is caught in
the same loop, with no pass over the output."""

PLAIN_HELPERS = (
    "#define gm_load(x) (x)",
    "#define gm_store(x) (x)",
    "#define GM_OVERFLOW(o) 0 /* a stored θ is the computed one: its check covers it */",
)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-std=c11", "-fPIC")
CACHE_ENV = "GRADMERGE_CACHE_DIR"


def kind(h: H) -> str:
    """A curvature's letter in a pattern: ``d`` (δ·I), ``h`` (a tensor), ``a`` (an Affine)."""
    return "a" if isinstance(h, Affine) else "h" if isinstance(h, Tensor) else "d"


def supports(base: Tensor, others: Sequence[Tensor], *, widened: bool = False) -> bool:
    """Whether the C loop handles these tensors: CPU, one dtype for all, float32/float64 (or,
    ``widened``, a dtype of :data:`WIDENED`: the loop then computes in float32)."""
    return (
        base.device.type == "cpu"
        and base.dtype in (WIDENED if widened else DTYPES)
        and all(x.device.type == "cpu" and x.dtype == base.dtype for x in others)
    )


def merge_tensor(
    base: Tensor,
    finetuned: Sequence[Tensor],
    alphas: Sequence[float],
    h: Sequence[H],
) -> Tensor | None:
    """Eq. 6 for one tensor by the C loop, or ``None`` when the result is not certified (a
    NaN/Inf, H̄ ≤ 0 or h < 0 somewhere). Raises ``RuntimeError`` (or ``OSError``) when the loop
    cannot be built; :func:`supports` must hold for ``base`` and ``finetuned`` + ``tensors(h)``.

    Tensors of a :data:`WIDENED` dtype (bfloat16) are computed in float32 and θ is written in
    their dtype: bit for bit ``merge_tensor`` of the tensors ``.float()`` followed by
    ``.to(torch.bfloat16)``, with a θ that rounds to ±Inf there uncertified (``None``) too."""
    pattern = "".join(kind(x) for x in h)
    consts, scalar_den = _constants(alphas, h)
    if scalar_den is not None and scalar_den <= 0:
        return None  # H̄ = c·I with c ≤ 0: the chunked path raises
    widened = base.dtype in WIDENED
    ctype = WIDENED[base.dtype] if widened else DTYPES[base.dtype]
    function = _function(pattern, ctype, "uint16_t" if widened else ctype)
    out = memory.empty(base.shape, like=base)
    flat = [x.reshape(-1).contiguous() for x in [out, base, *finetuned, *tensors(h)]]
    array = (ctypes.c_double * len(consts))(*consts)
    n, size = base.numel(), base.element_size()
    pointers = [x.data_ptr() for x in flat]

    def run(start: int, stop: int) -> int:  # elements [start, stop); the call releases the GIL
        return int(function(stop - start, array, *(p + start * size for p in pointers)))

    threads = min(torch.get_num_threads(), n // PARALLEL_MIN_NUMEL)
    if threads <= 1:
        return out if run(0, n) == 0 else None
    pieces = min(threads * PIECES_PER_THREAD, n // PARALLEL_MIN_NUMEL)
    step = -(-n // pieces // 64) * 64  # whole cache lines (and streamed blocks) per piece
    left: queue.SimpleQueue[int] = queue.SimpleQueue()  # the pieces' first elements
    for start in range(0, n, step):
        left.put(start)

    def work() -> int:  # pieces in turn until none is left
        bad = 0
        with contextlib.suppress(queue.Empty):
            while True:
                start = left.get_nowait()
                bad += run(start, min(start + step, n))
        return bad

    helpers = [_pool(threads - 1, os.getpid()).submit(work) for _ in range(threads - 1)]
    bad = work() + sum(f.result() for f in helpers)  # this thread works too, from the start
    return out if bad == 0 else None


@functools.cache
def _pool(threads: int, pid: int) -> ThreadPoolExecutor:
    """Worker threads, per process (a forked child has none of its parent's threads)."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gradmerge-eq6")


def _constants(alphas: Sequence[float], h: Sequence[H]) -> tuple[list[float], float | None]:
    """The scalars the loop needs, as the chunked path forms them (Python floats, rounded to the
    tensors' type inside the loop), and H̄ when every h is a scalar (else ``None``): α_1..α_T,
    then per h_i in order δ_i (δ·I) or scale_i, δ_i (Affine), then the scalar terms of H̄."""
    consts = [float(a) for a in alphas]
    for x in h:
        if isinstance(x, Affine):
            consts += [float(x.scale), float(x.delta)]
        elif not isinstance(x, Tensor):
            consts.append(float(x))
    tensor_seen = kind(h[0]) != "d"
    acc = 0.0 if tensor_seen else float(h[0])  # type: ignore[arg-type]  # H̄ while a Python float
    for alpha, x in zip(alphas, h[1:], strict=True):
        if kind(x) != "d":
            if not tensor_seen:  # de = α·h_t + acc: acc is the scalar prefix
                consts.append(acc)
            tensor_seen = True
        elif tensor_seen:  # de += α·x, the product in Python
            consts.append(float(alpha) * float(x))  # type: ignore[arg-type]
        else:
            acc = acc + float(alpha) * float(x)  # type: ignore[arg-type]
    if not tensor_seen:
        consts.append(acc)
        return consts, acc
    return consts, None


def source(pattern: str, ctype: str, stype: str | None = None) -> str:
    """C source of the loop for one pattern (``pattern[i]``: :func:`kind` of h_i), computing in
    ``ctype`` on tensors stored as ``stype`` (default ``ctype``; ``uint16_t``: bfloat16 bits,
    widened on load and rounded on store, :data:`BF16_HELPERS`).

    Signature: ``int64_t eq6(int64_t n, const double *c, S *out, const S *b, const S *f_1..f_T,
    const S *h_i (tensors and Affine values only))`` with ``c`` as :func:`_constants` lists it;
    returns the count of uncertified elements.
    """
    stype = stype or ctype
    tasks = len(pattern) - 1
    args = ["int64_t n", "const double *c", f"{stype} *restrict out", f"const {stype} *restrict b"]
    args += [f"const {stype} *restrict f{t}" for t in range(tasks)]
    args += [f"const {stype} *restrict h{i}" for i, p in enumerate(pattern) if p != "d"]
    k = tasks  # next constant
    prelude = [f"const {ctype} a{t} = ({ctype})c[{t}];" for t in range(tasks)]
    value, body = {}, []
    for i, p in enumerate(pattern):
        if p == "h":
            body.append(f"const {ctype} v{i} = gm_load(h{i}[i]);")
            value[i] = f"v{i}"
        elif p == "a":  # h_i = (c_i·scale_i) + δ_i, rounded as the operator algebra rounds it
            prelude.append(f"const {ctype} s{i} = ({ctype})c[{k}];")
            prelude.append(f"const {ctype} e{i} = ({ctype})c[{k + 1}];")
            body.append(f"const {ctype} v{i} = ({ctype})(gm_load(h{i}[i]) * s{i}) + e{i};")
            value[i], k = f"v{i}", k + 2
        else:
            prelude.append(f"const {ctype} s{i} = ({ctype})c[{k}];")
            value[i], k = f"s{i}", k + 1
    vector = pattern[0] != "d"  # H̄ is a vector once a tensor term has entered it
    if vector:
        body.append(f"{ctype} den = {value[0]};")
    for t in range(1, tasks + 1):
        if pattern[t] != "d":
            product = f"{value[t]} * a{t - 1}"
            if vector:
                body.append(f"den = den + ({ctype})({product});")
            else:
                prelude.append(f"const {ctype} d{t} = ({ctype})c[{k}];")
                k += 1
                body.append(f"{ctype} den = ({ctype})({product}) + d{t};")
            vector = True
        elif vector:
            prelude.append(f"const {ctype} d{t} = ({ctype})c[{k}];")
            k += 1
            body.append(f"den = den + d{t};")
    if not vector:
        prelude.append(f"const {ctype} den = ({ctype})c[{k}];")
    body.append(f"const {ctype} bi = gm_load(b[i]);")
    body.append(f"{ctype} rhs = ({ctype})0;")
    for t in range(tasks):
        body.append(f"{{ const {ctype} tau = gm_load(f{t}[i]) - bi;")
        body.append(f"  const {ctype} p = tau * {value[0]};")
        body.append(f"  const {ctype} q = tau * {value[t + 1]};")
        body.append(f"  const {ctype} term = (p + q) * a{t};")
        body.append("  rhs = rhs + term; }")
    body.append(f"const {ctype} theta = bi + rhs / den;")
    body.append(f"const {stype} o = gm_store(theta);")
    checks = ["(theta - theta != 0)", "GM_OVERFLOW(o)"]
    if pattern != "d" * len(pattern):
        checks.append("(den <= 0)")
    checks += [f"({value[i]} < 0)" for i, p in enumerate(pattern) if p != "d"]
    body.append(f"bad += {' | '.join(checks)};")

    def loop(start: str, stop: str, store: str) -> list[str]:
        return [
            f"for (int64_t i = {start}; i < {stop}; i++) {{",
            *(f"  {line}" for line in body),
            f"  {store} = o;",
            "}",
        ]

    lines = [
        "#include <float.h>",
        "#include <stddef.h>",
        "#include <stdint.h>",
        "#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0",
        '#error "each operation must round to its type (FLT_EVAL_METHOD == 0)"',
        "#endif",
        *STREAM_HELPERS,
        *(PLAIN_HELPERS if stype == ctype else BF16_HELPERS),
        f"int64_t eq6({', '.join(args)}) {{",
        *(f"  {line}" for line in prelude),
        "  int64_t bad = 0;",
        "  int64_t k = 0;  /* elements [0, k) are done */",
        "#if GM_STREAM",
        f"  if (n >= {STREAM_MIN_NUMEL} && (uintptr_t)out % sizeof({stype}) == 0) {{",
        f"    const int64_t head = (int64_t)((GM_ALIGN - (uintptr_t)out % GM_ALIGN) % GM_ALIGN)"
        f" / (int64_t)sizeof({stype});",
        *(f"    {line}" for line in loop("0", "head", "out[i]")),
        f"    _Alignas(GM_ALIGN) {stype} tmp[GM_BLOCK];",
        "    for (k = head; k + GM_BLOCK <= n; k += GM_BLOCK) {",
        *(f"      {line}" for line in loop("k", "k + GM_BLOCK", "tmp[i - k]")),
        "      gm_stream(out + k, tmp, sizeof tmp);",
        "    }",
        "    _mm_sfence();",
        "  }",
        "#endif",
        *(f"  {line}" for line in loop("k", "n", "out[i]")),
        "  return bad;",
        "}",
    ]
    return "\n".join(lines) + "\n"


@functools.cache
def _function(pattern: str, ctype: str, stype: str | None = None) -> Callable[..., int]:
    """The loaded C function of one pattern, compute and storage type (built, or found in the
    cache)."""
    library = ctypes.CDLL(
        str(_built(source(pattern, ctype, stype or ctype)))
    )  # CDLL: calls release the GIL
    function = library.eq6
    tensors = 2 + sum(p != "d" for p in pattern) + len(pattern) - 1
    function.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_double)]
    function.argtypes += [ctypes.c_void_p] * tensors
    function.restype = ctypes.c_int64
    return function


def _built(code: str) -> Path:
    """The shared library of ``code``: from the cache, else compiled into it atomically."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError("no C compiler found ($CC, else cc on PATH)")
    identity = "\n".join([code, compiler, *FLAGS, platform.machine(), _cpu_identity()])
    name = f"eq6-{hashlib.sha256(identity.encode()).hexdigest()[:24]}.so"
    folder = _cache_dir()
    target = folder / name
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as tmp:
        src, lib = Path(tmp) / "eq6.c", Path(tmp) / name
        src.write_text(code)
        command = [compiler, *FLAGS, "-shared", "-o", str(lib), str(src)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[:300]}")
        os.replace(lib, target)
    return target


def _cpu_identity() -> str:
    """The CPU's model and flags (``-march=native`` builds for them)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [
        line
        for line in text.splitlines()
        if line.split(":")[0].strip() in {"model name", "flags", "Features"}
    ]
    return "\n".join(sorted(set(keep)))


@functools.cache
def _cache_dir() -> Path:
    """A folder for built kernels that only this user can write; a private temporary one when
    the configured folder cannot be made so."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        folder = Path(configured)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        folder = Path(base) / "gradmerge"
    folder = folder / "kernels"
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = folder.stat()
        getuid = getattr(os, "getuid", None)  # POSIX; elsewhere the folder's mode alone
        if (getuid is None or info.st_uid == getuid()) and not info.st_mode & 0o022:
            return folder
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="gradmerge-kernels-"))
