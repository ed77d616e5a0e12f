"""The floor of K-FAC estimation on GPT-2-124M: its cost stage by stage, as ratios to one
forward+backward pass, all in one process (so that the ratios share the machine's load).

Setup: GPT-2-124M from its config (random weights; ``device_check.gpt2_inputs``: the model and
16 × 128 random tokens, as ``gpt2_kfac`` builds them; ``--sequences N``: the first N), read as
``gradmerge curvature MODEL DATA OUT --structure kfac --shift-labels --batch-size 4`` reads it
(the CLI's own parser and loader), and these stages, each one pass over the data, in ``--rounds``
interleaved rounds (each stage's ratio is taken to its round's forward+backward, the median over
rounds reported):

- ``forward_backward``: the yardstick of ``gpt2_kfac`` (summed cross-entropy of the shifted
  tokens, ``loss.backward()`` into every weight);
- ``hooks``: forward with hooks keeping every K-FAC layer's input and output (GPT-2's 48 Conv1D),
  the same loss, and the backward asked for those outputs' gradients only (K-FAC's backward: no
  weight gradients) — the least any K-FAC estimator does before its products;
- ``grams_float32``: ``hooks`` plus the Gram products A += aᵀa, G += gᵀg of every layer as whole
  float32 products (one ``addmm_`` each);
- ``grams_bfloat16``: the same products from bfloat16 operands (float32 sums in the GEMM, the
  product rounded to bfloat16: torch's CPU GEMMs return their operands' dtype);
- ``estimator``: ``estimate_kfac_factors(model, data)``, the estimator itself (kept positions,
  gathered rows, upper-triangle products, symmetrised factors, checks);
- ``estimator_with_diagonal``: with ``diagonal=True``, the estimator's pass in ``gradmerge
  curvature`` (plus the diagonal block of what K-FAC leaves out: in GPT-2 the LayerNorms, the
  position embedding and the tied embedding/head, whose per-example gradients are summed over
  positions before squaring);
- ``curvature``: ``gm.estimate.estimate_with``, what the CLI calls (the estimate and the
  ``gm.Blocks`` it returns), followed by ``save``, writing its file;

and, with ``--cli``, ``cli``: the whole ``gradmerge curvature`` command in a fresh process
(imports, loading, estimate, writing; ``gpt2_kfac --estimate-only``'s figure). Every stage is
timed in wall seconds and in CPU seconds of this process (of the command, for ``cli``): on a
shared machine the CPU seconds are what the work costs, the wall seconds also what the other jobs
took; the record holds both, and ratios of each.

    python -m benchmarks.kfac_floor --cli   # writes benchmarks/results/kfac-floor-cpu.json
    python -m benchmarks.kfac_floor --quick  # GPT-2 width 64, depth 2 (a test)
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from benchmarks import device_check
from benchmarks.record import RESULTS, Run, output, run_measured, write_result

RESULT = RESULTS / "kfac-floor-cpu.json"
STAGES = (
    "forward_backward",
    "hooks",
    "grams_float32",
    "grams_bfloat16",
    "estimator",
    "estimator_with_diagonal",
    "curvature",
)


def _cli_args(model: Path, data: Path, out: Path, fisher: str, batch: int) -> list[str]:
    """``gradmerge curvature``'s arguments for the estimate measured here."""
    return [
        "curvature", str(model), str(data), str(out), "--structure", "kfac", "--fisher", fisher,
        "--shift-labels", "--batch-size", str(batch), "--no-progress",
    ]  # fmt: skip


def load(model: Path, data: Path, fisher: str, batch: int) -> tuple[nn.Module, list[Any]]:
    """MODEL and DATA as ``gradmerge curvature`` reads them (its parser and loader)."""
    from gradmerge.cli import build_parser
    from gradmerge.commands._inputs import load as cli_load

    args = build_parser().parse_args(_cli_args(model, data, Path("unused"), fisher, batch))
    loaded, batches = cli_load(args, torch.device("cpu"), announce=False)
    return loaded, list(batches)


def forward_backward(model: nn.Module, batches: list[Any]) -> None:
    """``gpt2_kfac``'s yardstick: summed cross-entropy of the next tokens, every weight's gradient."""
    for batch in batches:
        logits = model(input_ids=batch["input_ids"]).logits
        loss = nn.functional.cross_entropy(
            logits.flatten(0, -2), batch["labels"].flatten(), reduction="sum"
        )
        loss.backward()
    model.zero_grad(set_to_none=True)


class Taps:
    """Forward hooks keeping each K-FAC layer's input rows and output edge (one batch)."""

    def __init__(self, model: nn.Module) -> None:
        from gradmerge.estimate._kfac_layers import (
            layer_kind,
        )  # the estimator's own test of a K-FAC layer

        self.layers = [m for m in model.modules() if layer_kind(m) in ("linear", "conv1d")]
        self.layers = [m for m in self.layers if _shared(model, m) == 1]
        self.inputs: list[Tensor] = []
        self.edges: list[Any] = []
        self.handles = [m.register_forward_hook(self.hook) for m in self.layers]

    def hook(self, module: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
        self.inputs.append(args[0].detach())
        self.edges.append(get_gradient_edge(out))

    def grads(self, model: nn.Module, batch: dict[str, Tensor]) -> list[Tensor]:
        """Forward, loss, and the backward to the noted outputs only."""
        self.inputs, self.edges = [], []
        logits = model(input_ids=batch["input_ids"]).logits
        loss = nn.functional.cross_entropy(
            logits.flatten(0, -2), batch["labels"].flatten(), reduction="sum"
        )
        return list(torch.autograd.grad(loss, self.edges))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _shared(model: nn.Module, module: nn.Module) -> int:
    """How many modules use ``module``'s weight (a tied head has 2: K-FAC leaves it out)."""
    return sum(getattr(m, "weight", None) is module.weight for m in model.modules())


def hooks_and_grams(model: nn.Module, batches: list[Any], dtype: torch.dtype | None) -> None:
    """The ``hooks`` stage; with ``dtype``, plus whole Gram products from operands in ``dtype``
    summed in float32 (``grams_float32`` / ``grams_bfloat16``)."""
    taps = Taps(model)
    sums: dict[int, Tensor] = {}
    try:
        for batch in batches:
            grads = taps.grads(model, batch)
            if dtype is None:
                continue
            for i, rows in enumerate(taps.inputs + grads):
                rows = rows.reshape(-1, rows.shape[-1])
                acc = sums.setdefault(i, rows.new_zeros(rows.shape[1], rows.shape[1]))
                if dtype == torch.float32:
                    acc.addmm_(rows.T, rows)
                else:
                    low = rows.to(dtype)
                    acc.add_(low.T @ low)
    finally:
        taps.remove()


def stages(model: nn.Module, batches: list[Any], fisher: str) -> dict[str, Callable[[], object]]:
    """Each stage of the module docstring as a call doing one pass over ``batches`` (``hooks``
    and ``grams_*`` backpropagate the observed labels' loss whatever ``fisher`` is: the same
    backward cost)."""
    from gradmerge.estimate import estimate_kfac_factors, estimate_with
    from gradmerge.estimate.options import EstimateOptions

    def kfac(**kw: Any) -> Callable[[], object]:
        return lambda: estimate_kfac_factors(model, batches, fisher=fisher, **kw)

    options = EstimateOptions(structure="kfac", fisher=fisher)
    return {
        "forward_backward": lambda: forward_backward(model, batches),
        "hooks": lambda: hooks_and_grams(model, batches, None),
        "grams_float32": lambda: hooks_and_grams(model, batches, torch.float32),
        "grams_bfloat16": lambda: hooks_and_grams(model, batches, torch.bfloat16),
        "estimator": kfac(),
        "estimator_with_diagonal": kfac(diagonal=True),
        "curvature": lambda: estimate_with(model, batches, options),
    }


def _seconds(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU seconds of ``fn()`` (CPU: this process's, or its children's when ``fn`` runs
    a command): on a shared machine the CPU seconds are what the work cost, the wall seconds
    also what the other jobs took."""
    wall, cpu, children = time.perf_counter(), time.process_time(), _children()
    fn()
    cpu = time.process_time() - cpu + _children() - children
    return time.perf_counter() - wall, cpu


def _children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The rounds (module docstring): seconds and ratios per stage."""
    model_dir, data = folder / "ft0", folder / "tokens0.safetensors"
    if not (model_dir.exists() and data.exists()):  # else a kept folder from an earlier run
        device_check.gpt2_inputs(folder, args.quick, tasks=1)
    if args.sequences:  # the first sequences only, as a file of their own (for the CLI too)
        tokens = {k: v[: args.sequences] for k, v in load_file(data).items()}
        data = folder / f"tokens0-{args.sequences}.safetensors"
        save_file(tokens, data)
    loaded: list[Any] = []
    loading = _seconds(lambda: loaded.extend(load(model_dir, data, args.fisher, args.batch_size)))
    model, batches = loaded
    todo = stages(model, batches, args.fisher)
    todo = {name: fn for name, fn in todo.items() if name in args.stages}
    todo["forward_backward"]()  # warm-up
    curvature = None
    rounds = []
    out = folder / "floor.kfac.safetensors"
    for r in range(args.rounds):
        row = {}
        for name, fn in todo.items():
            result: list[Any] = []
            row[name] = _seconds(lambda fn=fn, result=result: result.append(fn()))
            curvature = result[0] if name == "curvature" else curvature
        if curvature is not None:
            out.unlink(missing_ok=True)
            row["save"] = _seconds(lambda c=curvature: c.save(out))
        if args.cli:
            out.unlink(missing_ok=True)
            cmd = device_check.gradmerge(
                *_cli_args(model_dir, data, out, args.fisher, args.batch_size)
            )
            done: dict[str, Any] = {}
            row["cli"] = _seconds(lambda cmd=cmd, done=done: done.update(run_measured(cmd)))
            if done.get("returncode"):
                raise RuntimeError(f"round {r}: gradmerge curvature failed: {done.get('error')}")
        rounds.append(row)
        fb = row["forward_backward"]
        print(
            f"round {r}: "
            + ", ".join(
                f"{k} {w:.1f} s wall, {c:.1f} s CPU ({c / fb[1]:.2f}x)" for k, (w, c) in row.items()
            ),
            flush=True,
        )
    return {
        "tokens": sum(int(batch["input_ids"].numel()) for batch in batches),
        "load_seconds": {"wall": loading[0], "cpu": loading[1]},
        "rounds": [{k: {"wall": w, "cpu": c} for k, (w, c) in row.items()} for row in rounds],
        "median_ratio_cpu": _median(rounds, 1),
        "median_ratio_wall": _median(rounds, 0),
    }


def _median(rounds: list[dict[str, tuple[float, float]]], which: int) -> dict[str, float]:
    """Each stage's median over rounds of its seconds over its round's forward+backward."""
    return {
        name: statistics.median(row[name][which] / row["forward_backward"][which] for row in rounds)
        for name in rounds[0]
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--sequences", type=int, default=None, help="the first N of the 16 sequences (default: all)"
    )
    parser.add_argument("--fisher", choices=["empirical", "mc"], default="empirical")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument(
        "--cli", action="store_true", help="also the whole command, in a fresh process, per round"
    )
    parser.add_argument("--quick", action="store_true", help="GPT-2 width 64, depth 2 (a test)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--keep", type=Path, default=None, help="build in this folder, keep it")
    parser.add_argument(
        "--out",
        type=Path,
        help=f"default: {RESULT.name} in benchmarks/results (--quick: a temporary folder)",
    )
    args = parser.parse_args(argv)
    args.out = output(args.out, quick=args.quick, default=RESULT, name="kfac-floor")
    if "forward_backward" not in args.stages:
        parser.error("--stages must include forward_backward (the yardstick)")
    if args.threads:
        torch.set_num_threads(args.threads)
    run = Run("kfac_floor", settings=vars(args) | {"threads": torch.get_num_threads()}, argv=argv)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        results = measure(args, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="kfac-floor-") as tmp:
            results = measure(args, Path(tmp))
    write_result(args.out, run.finish(results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
