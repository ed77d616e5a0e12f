"""Run docs/tutorial.md as written: every ``python`` and ``bash`` block, in order, in one folder.

    make tutorial                       # the same as: python docs/tutorial.py runs/tutorial
    python docs/tutorial.py [FOLDER]    # FOLDER: empty or absent (default: a temporary folder)

The tutorial's blocks are cells of ONE session: ``python`` blocks run in one interpreter and
share one namespace (block 4 uses the ``batch`` and ``TASKS`` of block 1), ``bash`` blocks run
with ``bash -euo pipefail`` in the same folder, with this interpreter's ``bin`` folder first on
``PATH`` (so ``gradmerge`` is the virtual environment's command, as after ``source
.venv/bin/activate``). ``text`` blocks are what the block before them prints; they are not run
(the test suite checks them against the run: ``proofs_tests/notebooks/test_tutorial.py``). At
the end it prints the wall time of the whole run, the figure the tutorial states.

:func:`run` is the same as a function; given ``gradmerge`` (a callable taking the arguments of
one command and returning an object with ``returncode``, ``stdout`` and ``stderr``, e.g.
:func:`benchmarks.inprocess.run_cli`) each ``bash`` block runs with ``gradmerge`` a shell
function that records its arguments, and the recorded commands then run through that callable,
in order — the tutorial's commands in one process. That needs every ``gradmerge`` line to be a
plain command (no pipe, redirection or command substitution reading its output in the shell),
which :func:`run` checks.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TUTORIAL = Path(__file__).resolve().with_name("tutorial.md")
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.DOTALL | re.MULTILINE)
RUNNABLE = ("python", "bash")
# a gradmerge line whose output the shell itself would read (refused when commands are deferred)
READS_OUTPUT = re.compile(r"gradmerge[^\n]*(\||>|\$\(|`)|(\$\(|`)[^\n]*gradmerge")


@dataclass(frozen=True)
class Block:
    """One fenced block of the tutorial: its language, code and number (1-based, counting every
    fenced block, ``text`` ones included)."""

    number: int
    language: str
    code: str


@dataclass
class Transcript:
    """What a run printed: per block number, the text its commands wrote to stdout; and the
    whole run's wall seconds."""

    printed: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0

    def printed_lines(self) -> list[str]:
        """Every line printed, in order, stripped."""
        return [line.strip() for text in self.printed.values() for line in text.splitlines()]


def blocks(text: str | None = None) -> list[Block]:
    """The fenced blocks of ``text`` (default: docs/tutorial.md), in order."""
    text = TUTORIAL.read_text() if text is None else text
    return [Block(i, m.group(1), m.group(2)) for i, m in enumerate(FENCE.finditer(text), 1)]


class BlockFailed(RuntimeError):
    """A block of the tutorial failed: which one, and its error output."""


def run(
    folder: Path,
    *,
    gradmerge: Callable[[list[str]], Any] | None = None,
    echo: Callable[[str], None] | None = None,
    text: str | None = None,
) -> Transcript:
    """Run the tutorial's blocks in ``folder`` (module docstring); ``echo`` receives each
    block's output as it comes (default: nothing). Returns what each block printed.

    Raises:
        BlockFailed: a block exited non-zero or raised; the tutorial stops there.
    """
    import contextlib
    import io

    start = time.perf_counter()
    transcript = Transcript()
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    namespace: dict[str, object] = {"__name__": "__tutorial__"}
    env = os.environ | {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "HF_HUB_OFFLINE": "1",
    }
    previous = os.getcwd()
    os.chdir(folder)
    try:
        for block in blocks(text):
            if block.language not in RUNNABLE:
                continue
            if block.language == "python":
                out = io.StringIO()
                try:
                    with contextlib.redirect_stdout(out):
                        code = compile(block.code, f"tutorial.md, block {block.number}", "exec")
                        exec(code, namespace)
                except Exception as err:
                    raise BlockFailed(f"block {block.number} (python) raised {err!r}") from err
                printed = out.getvalue()
            elif gradmerge is None:
                printed = _bash(block, folder, env)
            else:
                printed = _bash_deferred(block, folder, env, gradmerge)
            transcript.printed[block.number] = printed
            if echo is not None:
                echo(printed)
    finally:
        os.chdir(previous)
    transcript.seconds = time.perf_counter() - start
    return transcript


def _bash(block: Block, folder: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise BlockFailed(f"block {block.number} (bash) exited {done.returncode}:\n{done.stderr}")
    return done.stdout


def _bash_deferred(
    block: Block, folder: Path, env: dict[str, str], gradmerge: Callable[[list[str]], Any]
) -> str:
    """The block with ``gradmerge`` recorded by bash, then run through ``gradmerge`` in order."""
    if READS_OUTPUT.search(block.code):
        raise BlockFailed(
            f"block {block.number}: a gradmerge command's output is read by the shell (pipe, "
            "redirection or $(...)); run the tutorial without a gradmerge callable"
        )
    with tempfile.NamedTemporaryFile("rb", suffix=".calls") as calls:
        record = f'gradmerge() {{ printf "%s\\0" "$#" "$@" >> "{calls.name}"; }}\n'
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", record + block.code],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise BlockFailed(
                f"block {block.number} (bash) exited {done.returncode}:\n{done.stderr}"
            )
        fields = calls.read().decode().split("\0")[:-1]
    printed = [done.stdout]
    while fields:
        count = int(fields.pop(0))
        argv, fields = fields[:count], fields[count:]
        result = gradmerge(argv)
        printed.append(result.stdout)
        if result.returncode != 0:
            raise BlockFailed(
                f"block {block.number}: gradmerge {' '.join(argv)} exited "
                f"{result.returncode}:\n{result.stderr}"
            )
    return "".join(printed)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python docs/tutorial.py",
        description="Run docs/tutorial.md's blocks in order in one folder (one Python session).",
    )
    parser.add_argument(
        "folder",
        nargs="?",
        type=Path,
        help="an empty or absent folder to run in (default: a new temporary folder)",
    )
    args = parser.parse_args(argv)
    folder = args.folder or Path(tempfile.mkdtemp(prefix="gradmerge-tutorial-"))
    if folder.exists() and any(folder.iterdir()):
        parser.error(f"{folder} is not empty: the tutorial starts from an empty folder")
    print(f"running docs/tutorial.md in {folder}", flush=True)
    try:
        transcript = run(folder, echo=lambda s: print(s, end="", flush=True))
    except BlockFailed as err:
        print(f"tutorial: error: {err}", file=sys.stderr)
        return 1
    print(f"the tutorial ran in {transcript.seconds:.0f} s (in {folder})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
