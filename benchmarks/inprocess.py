"""``gradmerge ARGS`` run in this process: what a subprocess gives, without its 2–6 s of imports.

:func:`run_cli` calls the command line's entry point, :func:`gradmerge.cli.main`, with ``argv``
and returns what ``subprocess.run([gradmerge, *argv], capture_output=True, text=True)`` returns
for the same call — the exit status, stdout and stderr as text — so that a study's ``--quick``
mode and the tutorial's test run dozens of commands in one interpreter (the imports are paid
once). It reproduces the process boundary:

* **exit status** as the ``gradmerge`` executable's: ``main``'s return value, a ``SystemExit``'s
  code (``None`` → 0, an int as is, anything else printed to stderr → 1, as Python does), an
  uncaught exception's traceback on stderr → 1;
* **output**: ``sys.stdout``/``sys.stderr`` captured (Python-level writes; C code writing to file
  descriptors 1/2 is not captured);
* **state a process would not leak** is saved before and restored after the call, whatever
  happens in it: the warning filters, ``showwarning``/``formatwarning`` and the once-per-location
  registries (a fresh process shows a ``default`` warning again), every logger's level, handlers,
  ``propagate`` and ``disabled`` and ``logging.disable``, transformers' and huggingface_hub's
  progress-bar switches, ``torch``'s thread count, default dtype, grad mode and global RNG,
  ``random``'s and numpy's global RNG, ``os.environ``, the working directory and ``sys.argv``.

``threads``: the torch thread count during the call (a subprocess started with
``OMP_NUM_THREADS=n`` computes with n threads; results that sum in parallel depend on it), and
``env``: variables set during the call (``HF_HUB_OFFLINE=1`` …), both restored after.

Results equal the subprocess path's (``proofs_tests/benchmarks/test_inprocess.py`` compares the
bytes of a curvature, a merge and an ``inspect`` JSON written both ways). Keep one subprocess smoke
per command elsewhere: this path skips the console-script wrapper and the import of a cold process.

Example::

    >>> done = run_cli(["--version"])  # doctest: +SKIP
    >>> done.returncode, done.stdout  # doctest: +SKIP
    (0, 'gradmerge 0.…\\n')
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import random
import sys
import traceback
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Completed:
    """What a finished ``gradmerge`` call gave: as :class:`subprocess.CompletedProcess`."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


def run_cli(
    argv: Sequence[str | Path],
    *,
    env: Mapping[str, str] | None = None,
    threads: int | None = None,
) -> Completed:
    """``gradmerge *argv`` in this process (module docstring): exit status, stdout, stderr."""
    from gradmerge.cli import main

    args = [str(a) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    with restored_state(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        os.environ.update(env or {})
        sys.argv = ["gradmerge", *args]
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        try:
            code = exit_status(main(args))
        except SystemExit as stop:
            code = exit_status(stop.code)
        except Exception:  # what the interpreter prints for an uncaught exception, exit 1
            traceback.print_exc()
            code = 1
    return Completed(args, code, out.getvalue(), err.getvalue())


def exit_status(code: object) -> int:
    """The process exit status Python gives ``sys.exit(code)``: None → 0, an int as is, any
    other object printed to stderr → 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


@contextlib.contextmanager
def restored_state() -> Iterator[None]:
    """Save the interpreter state a command may change (module docstring); restore it on exit."""
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), list(sys.argv)
    saved_random = random.getstate()
    loggers = _loggers()
    logging_disable = logging.root.manager.disable
    optional = _optional_state()
    with warnings.catch_warnings():  # filters, showwarning; resets the once-registries
        saved_format = warnings.formatwarning
        try:
            yield
        finally:
            warnings.formatwarning = saved_format
            os.environ.clear()
            os.environ.update(saved_env)
            os.chdir(saved_cwd)
            sys.argv = saved_argv
            random.setstate(saved_random)
            _restore_loggers(loggers)
            logging.disable(logging_disable)
            for restore in optional:
                restore()


def _loggers() -> dict[str, tuple[int, list[logging.Handler], bool, bool]]:
    found = {"": logging.getLogger()}
    found |= {
        name: lg
        for name, lg in logging.Logger.manager.loggerDict.items()
        if isinstance(lg, logging.Logger)
    }
    return {
        name: (lg.level, list(lg.handlers), lg.propagate, lg.disabled) for name, lg in found.items()
    }


def _restore_loggers(saved: dict[str, tuple[int, list[logging.Handler], bool, bool]]) -> None:
    for name, lg in logging.Logger.manager.loggerDict.items():  # created during the call
        if isinstance(lg, logging.Logger) and name not in saved:
            lg.setLevel(logging.NOTSET)
            lg.handlers.clear()
            lg.propagate, lg.disabled = True, False
    for name, (level, handlers, propagate, disabled) in saved.items():
        lg = logging.getLogger(name or None)
        lg.setLevel(level)
        lg.handlers[:] = handlers
        lg.propagate, lg.disabled = propagate, disabled


def _optional_state() -> list[Any]:
    """Restorers of the state of modules already imported (torch, numpy, transformers,
    huggingface_hub); a module imported during the call starts from its defaults, as in a
    fresh process, and its changes are undone where its defaults are known (torch)."""
    restorers: list[Any] = []
    import torch  # the CLI imports it anyway; its state is the one that matters most

    threads, dtype, grad = (
        torch.get_num_threads(),
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
    )
    rng = torch.get_rng_state()
    deterministic = torch.are_deterministic_algorithms_enabled()

    def restore_torch() -> None:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.set_rng_state(rng)
        torch.use_deterministic_algorithms(deterministic)

    restorers.append(restore_torch)
    if "numpy" in sys.modules:
        np = sys.modules["numpy"]
        state = copy.deepcopy(np.random.get_state())
        restorers.append(lambda: np.random.set_state(state))
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None and hasattr(hf_logging, "is_progress_bar_enabled"):
        bars = hf_logging.is_progress_bar_enabled()
        restorers.append(
            lambda: hf_logging.enable_progress_bar() if bars else hf_logging.disable_progress_bar()
        )
    hub = sys.modules.get("huggingface_hub.utils.tqdm")
    states = getattr(hub, "progress_bar_states", None)
    if isinstance(states, dict):
        groups = dict(states)

        def restore_hub() -> None:
            states.clear()
            states.update(groups)

        restorers.append(restore_hub)
    return restorers
