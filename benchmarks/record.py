"""The benchmark suite's one record: machine facts, load, timing, and writing results.

Every results file in ``benchmarks/results/`` is ONE JSON object of this shape (``SCHEMA``)::

    {
      "schema": "gradmerge-benchmark/1",
      "benchmark": "merge",                              # the module: python -m benchmarks.merge
      "command": "python -m benchmarks.merge --quick",  # the exact command line that wrote it
      "git": {"commit": "36d4f0a…", "dirty": false},     # the tree that ran (dirty: uncommitted edits)
      "machine": {"cpu_model": …, "cpus": 2, "gpu": null, "torch": "2.13.0", …},
      "load": {"before": [1, 5, 15 min], "after": [...], "nice": 15},
      "started": "2026-11-27T02:30:00Z", "seconds": 12.3,
      "settings": {...},                                 # the parsed arguments
      "results": {...}                                   # what the benchmark measured
    }

A benchmark builds it in three steps::

    run = Run("merge", settings=vars(args))    # notes the command, machine, load and start time
    results = {...}                             # measure
    write_result(path, run.finish(results))     # load after, seconds; validated, written atomically

``write_result`` writes every ``command`` string without machine paths (:func:`portable`);
``write_result(path, record, figure=draw)`` also writes the study's plot beside it (``.png``),
drawn into a temporary file first: the suite's one writer of results files.

``problems(record)`` lists what keeps a record from the schema (``validate`` raises them as one
``RecordError``); ``proofs_tests/benchmarks/test_results.py`` checks every committed results
file with it. Timings on a shared machine are only comparable within one run: report ratios taken
in the same process, and the load recorded here with them.

Example::

    >>> record = Run("example", settings={"n": 3}, argv=["--n", "3"]).finish({"answer": 42})
    >>> record["command"], problems(record)
    ('python -m benchmarks.example --n 3', [])
"""

from __future__ import annotations

import gc
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA = "gradmerge-benchmark/1"
KEYS = (
    "schema",
    "benchmark",
    "command",
    "git",
    "machine",
    "load",
    "started",
    "seconds",
    "settings",
    "results",
)
MACHINE_KEYS = (
    "platform",
    "python",
    "torch",
    "gradmerge",
    "cpu_model",
    "cpus",
    "memory_bytes",
    "gpu",
)
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


class RecordError(ValueError):
    """A results record that does not follow ``SCHEMA`` (the message lists every problem)."""


# ----- facts -------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def machine() -> dict[str, Any]:
    """What ran the benchmark: OS, Python, torch and gradmerge versions, CPU model and logical
    cores, physical memory, torch's intra-op threads, OMP_NUM_THREADS and the GPU (``None``
    when torch sees none)."""
    import torch

    import gradmerge

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gradmerge": gradmerge.__version__,
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "gpu": gpu,
    }


def load() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded to 0.01."""
    return [round(v, 2) for v in os.getloadavg()]


def git_state(root: Path = ROOT) -> dict[str, Any]:
    """The commit of ``root``'s checkout and whether tracked files differ from it (``commit``
    is ``None`` outside a git checkout)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
            )
        except (OSError, subprocess.CalledProcessError):
            return None
        return done.stdout.strip()

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def command(benchmark: str, argv: Sequence[str] | None = None) -> str:
    """The command line that runs ``benchmark`` with ``argv`` (default: this process's
    arguments), as a shell would take it."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", "-m", f"benchmarks.{benchmark}", *args])


ABSOLUTE = re.compile(r"(?:(?<=[\s='\"])|^)(/[^\s'\"]*)")
"""An absolute path in a command line: a token (or an ``--opt=`` value) starting with ``/``."""


def portable(text: str, folders: Mapping[str, str] | None = None) -> str:
    """The command line ``text`` without machine paths: every absolute path under the
    repository becomes relative to it, one under a named folder of ``folders`` (name → absolute
    path, e.g. ``{"WORK": "/scratch/runs"}``) becomes ``NAME/rest``, any other becomes
    ``TMP/`` + its last component. Committed records name no folder of the machine that ran them.

    Example:
        >>> portable("gradmerge merge /w/runs/a/m.yaml /tmp/x/out", {"WORK": "/w/runs"})
        'gradmerge merge WORK/a/m.yaml TMP/out'
    """
    named = sorted((folders or {}).items(), key=lambda kv: -len(kv[1]))

    def one(match: re.Match[str]) -> str:
        path = match.group(1)
        root = str(ROOT)
        if path == root or path.startswith(root + "/"):
            return os.path.relpath(path, root)
        for name, folder in named:
            folder = folder.rstrip("/")
            if path == folder or path.startswith(folder + "/"):
                return name + path[len(folder) :]
        return "TMP/" + path.rstrip("/").rsplit("/", 1)[-1]

    return ABSOLUTE.sub(one, text)


def portable_commands(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with every ``"command"`` string in it (the top one and those of its logs)
    passed through :func:`portable`, the named folders being the settings that hold an absolute
    path outside the repository (``--work DIR`` → ``WORK``)."""
    settings = record.get("settings") if isinstance(record.get("settings"), dict) else {}
    folders = {
        key.upper(): str(value)
        for key, value in (settings or {}).items()
        if isinstance(value, (str, Path))
        and str(value).startswith("/")
        and not str(value).startswith(str(ROOT))
    }

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                k: portable(v, folders) if k == "command" and isinstance(v, str) else walk(v)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    out: dict[str, Any] = walk(record)
    return out


def output(out: Path | None, *, quick: bool, default: Path, name: str) -> Path:
    """Where a benchmark writes its record (a file or a folder, as ``default``): ``out`` when
    given (``--out``, asked for), else ``default`` for a full run — a committed record under
    :data:`RESULTS` — and for a ``--quick`` run a new temporary folder (``default``'s name
    inside it): a smoke run is no result, so it never lands in :data:`RESULTS` unless asked.

    Example:
        >>> output(None, quick=False, default=RESULTS / "x.json", name="x") == RESULTS / "x.json"
        True
        >>> RESULTS in output(None, quick=True, default=RESULTS / "x.json", name="x").parents
        False
    """
    if out is not None:
        return out
    if not quick:
        return default
    return Path(tempfile.mkdtemp(prefix=f"{name}-quick-")) / default.name


def module_argv(benchmark: str, *args: str) -> list[str]:
    """The argv that runs ``benchmark`` in a fresh Python process (run it from the repository's
    root, as the parent was)."""
    return [sys.executable, "-m", f"benchmarks.{benchmark}", *args]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _plain(value: Any) -> Any:
    """``value`` with paths, tuples and sets as JSON values (settings from ``vars(args)``)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


class Run:
    """One run of a benchmark: created before measuring, ``finish``-ed into its record.

    Args:
        benchmark: the module's name under ``benchmarks`` (``python -m benchmarks.<benchmark>``).
        settings: the parsed arguments (``vars(args)``) and any other setting the figures depend on.
        argv: the arguments on the command line (default ``sys.argv[1:]``).
    """

    def __init__(
        self,
        benchmark: str,
        settings: Mapping[str, Any] | None = None,
        argv: Sequence[str] | None = None,
    ) -> None:
        self.benchmark = benchmark
        self.settings = _plain(dict(settings or {}))
        self.command = command(benchmark, argv)
        self.git = git_state()  # the tree as it was when the run began
        self.started = _now()
        self.load_before = load()
        self._start = time.perf_counter()

    def finish(self, results: Mapping[str, Any] | list[Any]) -> dict[str, Any]:
        """The record of this run with ``results``; load and elapsed time are taken now."""
        return {
            "schema": SCHEMA,
            "benchmark": self.benchmark,
            "command": self.command,
            "git": self.git,
            "machine": machine(),
            "load": {"before": self.load_before, "after": load(), "nice": os.nice(0)},
            "started": self.started,
            "seconds": round(time.perf_counter() - self._start, 3),
            "settings": self.settings,
            "results": results,
        }


# ----- validation and writing --------------------------------------------------------------------
def problems(record: Any) -> list[str]:
    """Every way ``record`` departs from ``SCHEMA`` (empty when it follows it)."""
    if not isinstance(record, dict):
        return [f"expected a JSON object, got {type(record).__name__}"]
    out = []
    missing = [k for k in KEYS if k not in record]
    extra = [k for k in record if k not in KEYS]
    if missing:
        out.append(f"missing keys {missing}")
    if extra:
        out.append(f"unexpected top-level keys {extra} (put them under 'settings' or 'results')")
    if record.get("schema", SCHEMA) != SCHEMA:
        out.append(f"schema is {record['schema']!r}, expected {SCHEMA!r}")
    benchmark = record.get("benchmark")
    if "benchmark" in record and not (isinstance(benchmark, str) and benchmark.isidentifier()):
        out.append(f"benchmark must be a module name, got {benchmark!r}")
    cmd = record.get("command")
    if "command" in record and not (
        isinstance(cmd, str) and cmd.startswith(f"python -m benchmarks.{benchmark}")
    ):
        out.append(f"command must start with 'python -m benchmarks.{benchmark}', got {cmd!r}")
    git = record.get("git")
    if "git" in record and not (
        isinstance(git, dict)
        and (git.get("commit") is None or isinstance(git.get("commit"), str))
        and "dirty" in git
    ):
        out.append(f"git must be {{'commit': str | null, 'dirty': bool | null}}, got {git!r}")
    mach = record.get("machine")
    if "machine" in record:
        if not isinstance(mach, dict):
            out.append(f"machine must be an object, got {mach!r}")
        elif absent := [k for k in MACHINE_KEYS if k not in mach]:
            out.append(f"machine lacks {absent}")
    ld = record.get("load")
    if "load" in record and not (
        isinstance(ld, dict)
        and all(
            isinstance(ld.get(k), list)
            and len(ld[k]) == 3
            and all(isinstance(v, (int, float)) for v in ld[k])
            for k in ("before", "after")
        )
    ):
        out.append(f"load must hold 'before' and 'after' as three load averages, got {ld!r}")
    seconds = record.get("seconds")
    if "seconds" in record and not (isinstance(seconds, (int, float)) and seconds >= 0):
        out.append(f"seconds must be a non-negative number, got {seconds!r}")
    if "started" in record and not isinstance(record["started"], str):
        out.append(f"started must be an ISO time string, got {record['started']!r}")
    if "settings" in record and not isinstance(record["settings"], dict):
        out.append(f"settings must be an object, got {type(record['settings']).__name__}")
    if "results" in record and not isinstance(record["results"], (dict, list)):
        out.append(f"results must be an object or a list, got {type(record['results']).__name__}")
    return out


def validate(record: Any) -> None:
    """Raise ``RecordError`` naming every problem when ``record`` does not follow ``SCHEMA``."""
    found = problems(record)
    if found:
        raise RecordError("not a benchmark record: " + "; ".join(found))


def write_result(
    path: str | Path,
    record: dict[str, Any],
    *,
    figure: Callable[[Path], object] | None = None,
) -> Path:
    """Validate ``record`` and write it to ``path`` as indented JSON, whole or not at all (a
    temporary file in the same folder, renamed over ``path``). NaN and infinity are refused
    (JSON has none): store them as ``None`` with a note.

    ``figure``, where given, draws the record's plot into the path it is passed (e.g.
    ``lambda p: fig.savefig(p)``); the plot goes beside the JSON, ``path`` with the suffix
    ``.png``, also drawn into a temporary file first: a record or a drawing that fails leaves
    both files as they were. The suite's one writer of results files."""
    validate(record)
    record = portable_commands(record)
    path = Path(path)
    text = json.dumps(record, indent=1, ensure_ascii=False, allow_nan=False) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    png = path.with_suffix(".png")
    made: list[Path] = []
    try:
        if figure is not None:  # ends in .png: matplotlib takes the format from the name
            made.append(_temporary(png))
            figure(made[-1])
        made.append(_temporary(path))
        made[-1].write_text(text, encoding="utf-8")
        os.replace(made[-1], path)
        if figure is not None:
            os.replace(made[0], png)
    except BaseException:
        for tmp in made:
            tmp.unlink(missing_ok=True)
        raise
    return path


def _temporary(path: Path) -> Path:
    """An empty file beside ``path``, named ``.<name>.<random>.tmp<suffix>``, readable as
    ``open()`` would create it (``mkstemp`` gives 0600)."""
    fd, tmp = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp{path.suffix}"
    )
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    return Path(tmp)


def read_result(path: str | Path) -> dict[str, Any]:
    """The record in ``path``, validated (``RecordError`` when it does not follow ``SCHEMA``)."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise RecordError(f"{path}: not JSON ({err})") from err
    try:
        validate(record)
    except RecordError as err:
        raise RecordError(f"{path}: {err}") from err
    return record


# ----- timing ------------------------------------------------------------------------------------
def timed(fn: Callable[[], object], repeats: int, *, warmup: bool = True) -> list[float]:
    """Wall times (s) of ``repeats`` calls of ``fn``, each after a garbage collection (and one
    untimed warm-up call first unless ``warmup=False``)."""
    if warmup:
        fn()
    out = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of a process, in bytes (empty once it has exited)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def run_measured(cmd: list[str], *, cwd: str | None = None) -> dict[str, Any]:
    """Run ``cmd``, sampling its memory every 5 ms: wall time, peak RSS and RssAnon, return
    code, the last lines of stderr when it failed, and the last JSON line of its stdout merged in."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = {"VmRSS": 0, "VmHWM": 0, "RssAnon": 0}

    def sample() -> None:
        while proc.poll() is None:
            status = proc_status(proc.pid)
            for k in peak:
                peak[k] = max(peak[k], status.get(k, 0))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    sampler.join()
    wall = time.perf_counter() - start
    result: dict[str, Any] = {
        "wall_seconds": wall,
        "peak_rss_bytes": max(peak["VmRSS"], peak["VmHWM"]),
        "peak_rss_anon_bytes": peak["RssAnon"],
        "returncode": proc.returncode,
    }
    if proc.returncode != 0:
        result["error"] = stderr.strip().splitlines()[-5:]
    lines = [ln for ln in stdout.strip().splitlines() if ln.startswith("{")]
    if lines:
        result.update(json.loads(lines[-1]))
    return result
