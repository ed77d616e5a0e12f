r"""An end-to-end merging and removal study on real data: ``gradmerge demo`` / :func:`run_demo`.

scikit-learn's handwritten digits (shipped with the library, no download) are cut into a base
set and T domain-shifted tasks of the same ten classes (rotated, mirrored, shifted images: the
analogue of the paper's sentiment data from different domains). A small MLP (64 → 16 → 10,
1210 parameters, float64) is trained on the base set (θ_LLM) and fine-tuned on each task with
the prior (δ/2)‖θ − θ_LLM‖² (θ_t, Eq. 15); every model is a MAP trained to ‖∇F‖_∞ ≤ 1e-9 by
Newton's method. The study then

- estimates each task's GGN (= Fisher) at θ_t as a diagonal, K-FAC and full matrix
  (``gm.estimate_curvature``);
- merges with task arithmetic, Fisher averaging, RegMean and gradient matching (Eq. 6) with each
  structure, for several α, and compares with the exact multi-task target
  θ_{1:T} = argmin Σ_t α ℓ̄_t(θ) + (δ/2)‖θ − θ_LLM‖² (held-out accuracy, distance, and the
  gradient mismatch of Eq. 2, ``gm.gradient_mismatch``);
- refines the full-curvature merge towards θ_{1:T} with k steps of ``gm.refine`` (gradients and
  full GGN re-estimated at each iterate; Sec. 1.5);
- removes one task from the model trained on all of them with Eq. 13 (``gm.remove``) and with
  Koh & Liang's step (``gm.influence_remove``), against retraining without it.

Modules: :mod:`~gradmerge.demo.data` (digits and shifts), :mod:`~gradmerge.demo.mlp` (the model
and its exact Hessian), :mod:`~gradmerge.demo.training` (Newton MAP fits),
:mod:`~gradmerge.demo.methods` (the gradmerge calls), :mod:`~gradmerge.demo.study` (the steps),
:mod:`~gradmerge.demo.results` (tables, JSON), :mod:`~gradmerge.demo.plots` (PNG figures); the
output directory is checked and written all at once by the output guard every command uses
(:mod:`gradmerge.foundation.guard`).

Example:
    >>> from gradmerge.demo import run_demo
    >>> results = run_demo(quick=True, log=None)               # doctest: +SKIP
    >>> print(results.merge_table())                           # doctest: +SKIP
    >>> run_demo("runs/demo")          # the full study: table, results.json, plots  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gradmerge.foundation.extras import require

require("demo", "the demo (gradmerge demo, gradmerge.demo)")

import torch  # noqa: E402 (after the check for scikit-learn and matplotlib)

from gradmerge.demo.config import DemoConfig  # noqa: E402
from gradmerge.demo.results import DemoResults  # noqa: E402
from gradmerge.errors import ArgumentError  # noqa: E402
from gradmerge.foundation.devices import resolve_device  # noqa: E402
from gradmerge.foundation.guard import Output, check, staged_folder  # noqa: E402

__all__ = ["DemoConfig", "DemoResults", "run_demo", "resolve_device", "check_output"]


def run_demo(
    out: str | os.PathLike[str] | None = None,
    *,
    quick: bool = False,
    device: str | torch.device = "auto",
    seed: int = 0,
    overwrite: bool = False,
    config: DemoConfig | None = None,
    threads: int | None = 1,
    log: Callable[[str], None] | None = print,
) -> DemoResults:
    """Run the study; with ``out``, write ``results.json``, ``table.txt`` and the PNG plots there.

    Args:
        out: the output directory (None: write nothing). It must not exist, or be replaced
            with ``overwrite=True``; it is built in a hidden sibling and renamed into place
            when complete (:func:`gradmerge.foundation.guard.staged_folder`).
        quick: the small preset (:meth:`DemoConfig.quick`: seconds, for tests).
        device: ``"auto"`` (CUDA if available), ``"cpu"``, ``"cuda"``.
        seed: the data split and the initialisation; the results are a function of the seed
            and the device.
        overwrite: replace an existing ``out``.
        config: settings other than the presets (then ``quick`` and ``seed`` are ignored).
        threads: torch's CPU threads during the run, restored after (None: leave as is). The
            default 1 is the fastest here: the matrices are small, and more threads contend on a
            busy machine (figures in ``benchmarks/README.md``).
        log: receives progress lines (None: quiet).

    Returns:
        The :class:`DemoResults` (the same numbers as ``results.json``).

    Raises:
        OutputExistsError, OutputWriteError: an unusable ``out`` (existing without
            ``overwrite``; a file, below a file, not writable), checked before any work
            (:func:`check_output`); a full disk while writing.
        ArgumentError: a bad ``device`` name.
        DeviceError: CUDA asked for but not available.
    """
    from gradmerge.demo.plots import write_plots
    from gradmerge.demo.study import run_study

    if config is None:
        config = DemoConfig.quick(seed=seed) if quick else DemoConfig.full(seed=seed)
    resolved = resolve_device(device)
    if threads is not None and threads < 1:
        raise ArgumentError(f"threads must be at least 1 (or None), got {threads}")
    say = log if log is not None else (lambda line: None)
    if out is None:
        with _threads(threads):
            return run_study(config, resolved, log=say)
    check_output(out, overwrite=overwrite)
    with staged_folder(out, overwrite=overwrite, role="--out") as staging, _threads(threads):
        results = run_study(config, resolved, log=say)
        (staging / "results.json").write_text(
            json.dumps(_finite(results.to_dict()), indent=2) + "\n"
        )
        (staging / "table.txt").write_text(results.summary() + "\n")
        write_plots(results, staging)
    say(
        f"wrote {Path(out)}/: results.json, table.txt, accuracy_vs_alpha.png, error_vs_mismatch.png"
    )
    return results


def check_output(out: str | os.PathLike[str], *, overwrite: bool) -> Path:
    """The output guard (:func:`gradmerge.foundation.guard.check`) for the demo's ``out``: the study
    reads no file, so only rules 2-3 apply (exists without ``overwrite``; a file, below a file,
    or not writable). Returns ``out`` as a Path.

    Raises:
        OutputExistsError, OutputWriteError: as :func:`gradmerge.foundation.guard.check`.
    """
    path = Path(out)
    check([Output("--out", path, "folder")], [], overwrite=overwrite)
    return path


@contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """Run with ``count`` torch CPU threads, then restore the previous setting."""
    previous = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
