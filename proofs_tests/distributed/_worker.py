"""One rank of a distributed test job: ``python _worker.py JOB OUTDIR`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set (by torchrun, or by the test as torchrun would). Writes
OUTDIR/rank{RANK}.pt.

Jobs:
- ``main``: every case of ``cases.CASES`` estimated across the ranks; a DDP-wrapped model; the
  command line (a good run and a run where a rank fails); ranks that disagree or fail, each
  raising DistributedError on every rank; a good estimate after them (the group is still in
  step); last, a rank that comes later than the others' timeout.
- ``kill``: a rank that dies in the middle of its shard.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import gradmerge.distributed as gmd
from proofs_tests.distributed import cases

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
PATIENCE = 300
"""Seconds a rank waits for the others (every call's ``timeout`` and the group's, except the late
rank's deliberate 1 s): a guard against a hang only. No outcome here waits for it — each failure
is an answer or a closed connection — and on a busy machine a peer can be descheduled for tens of
seconds, which a shorter timeout would turn into a spurious ``DistributedError``."""


def record(C) -> dict:
    return {
        "type": type(C).__name__,
        "dense": C.dense(),
        "layout": [(k, tuple(s)) for k, s in C.layout],
        "meta": dict(C.meta),
    }


def attempt(fn) -> dict:
    """Run ``fn``; the outcome: its result or the error's type, message, failures, cause."""
    start = time.perf_counter()
    try:
        out = {"ok": record(fn())}
    except Exception as err:
        out = {
            "error": type(err).__name__,
            "message": str(err),
            "failures": getattr(err, "failures", None),
            "cause": type(err.__cause__).__name__ if err.__cause__ else None,
        }
    out["seconds"] = time.perf_counter() - start
    return out


def job_main() -> dict:
    out, seconds = {}, {}
    for part in (job_agree, job_cli, job_merge, job_bad):
        start = time.perf_counter()
        out.update(part())
        seconds[part.__name__] = time.perf_counter() - start
    return {**out, "seconds": seconds}


def job_agree() -> dict:
    results = {}
    for name, model_fn, data_fn, options in cases.CASES:
        model, data = cases.build(model_fn), cases.build(data_fn)
        C = gmd.estimate_curvature(model, gmd.shard(data), timeout=PATIENCE, **options)
        results[name] = record(C)
    results["ddp"] = ddp_case()
    return results


def ddp_case() -> dict:
    """Estimate through a DDP wrapper: no DDP all-reduce, no .grad; DDP still trains after."""
    model = cases.lm_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    calls = []

    def hook(state, bucket):
        calls.append(bucket.index())
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] / WORLD)

    ddp.register_comm_hook(None, hook)
    data = gmd.shard(cases.lm_batches())
    out = {
        "kfac": record(gmd.estimate_curvature(ddp, data, structure="kfac", timeout=PATIENCE)),
        "diag": record(gmd.estimate_curvature(ddp, data, structure="diag", timeout=PATIENCE)),
        "full": record(gmd.estimate_curvature(ddp, data, structure="full", timeout=PATIENCE)),
    }
    out["hook_calls_after_estimates"] = len(calls)
    out["grads_after_estimates"] = [p.grad is None for p in model.parameters()]
    ids, targets = data[0]
    loss = nn.functional.cross_entropy(ddp(ids).reshape(-1, cases.CLASSES), targets.reshape(-1))
    loss.backward()
    out["hook_calls_after_step"] = len(calls)
    out["grads_after_step"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out


def job_cli() -> dict:
    """``gradmerge.distributed curvature`` in this group: a good run, and one where rank 1 fails."""
    import contextlib
    import io

    from gradmerge.commands.distributed import main as cli

    outdir = Path(sys.argv[2])
    entry = f"{Path(cases.__file__).resolve()}"
    out = {}
    for name, data in (("cli_ok", "mlp_batches"), ("cli_fail", "mlp_batches_nan_last")):
        target = outdir / f"{name}.safetensors"
        argv = ["curvature", f"{entry}:mlp_model", f"{entry}:{data}", str(target)]
        argv += [
            "--structure",
            "kfac",
            "--loss",
            "mse",
            "--no-progress",
            "--timeout",
            str(PATIENCE),
        ]
        stderr, stdout = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
            status = cli(argv)
        out[name] = {"status": status, "stderr": stderr.getvalue(), "stdout": stdout.getvalue()}
        out[name]["exists_after"] = target.exists()
    # `gradmerge curvature --distributed`: the single-process command's flag, same path
    from gradmerge.cli import main as gradmerge_cli

    target = outdir / "cli_flag.safetensors"
    argv = ["curvature", f"{entry}:mlp_model", f"{entry}:mlp_batches", str(target)]
    argv += ["--structure", "diag", "--loss", "mse", "--no-progress", "--distributed"]
    stderr, stdout = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        status = gradmerge_cli([*argv, "--timeout", str(PATIENCE), "--expected-examples", "12"])
    out["cli_flag"] = {"status": status, "stderr": stderr.getvalue(), "stdout": stdout.getvalue()}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        argv = ["merge", str(Path(sys.argv[3]) / "merge_ta.yaml"), str(outdir / "cli_merge")]
        status = cli([*argv, "--timeout", str(PATIENCE), "--no-progress"])
    out["cli_merge"] = {"status": status, "stdout": stdout.getvalue()}
    return out


def job_merge() -> dict:
    """Distributed merges/removals over the workspace in argv[3], written to OUTDIR/<case>."""
    from gradmerge.distributed.merge import run_merge, run_remove

    root, outdir = sys.argv[3], Path(sys.argv[2])
    out = {}
    for name in [*cases.MERGES, "merge_fail", "merge_exists", "remove_refused"]:
        command, config = cases.merge_config(
            root, "merge_gm_kfac" if name == "merge_exists" else name
        )
        target = outdir / ("merge_gm_kfac" if name == "merge_exists" else name)
        run = run_merge if command == "merge" else run_remove
        start = time.perf_counter()
        try:
            report = run(config, target, timeout=PATIENCE)
            out[name] = {
                "files": [p.name for p in report.files],
                "units": report.units,
                "bytes_written": report.bytes_written,
            }
        except Exception as err:
            out[name] = {
                "error": type(err).__name__,
                "message": str(err),
                "failures": getattr(err, "failures", None),
            }
        out[name]["seconds"] = time.perf_counter() - start
    return out


def job_bad() -> dict:
    lm, mlp = cases.lm_model, cases.mlp_model
    shard = gmd.shard
    out = {}

    def perturbed():  # rank 1 holds a model one ulp away from rank 0's
        model = lm()
        if RANK == 1:
            with torch.no_grad():
                w = model.hidden.weight
                w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(float("inf"), dtype=w.dtype))
        return model

    data = shard(cases.lm_batches())
    out["model"] = attempt(lambda: gmd.estimate_curvature(perturbed(), data, timeout=PATIENCE))
    out["options"] = attempt(
        lambda: gmd.estimate_curvature(
            lm(), data, fisher="mc" if RANK == 1 else "empirical", timeout=PATIENCE
        )
    )
    nan_data = shard(cases.mlp_batches_nan_last())
    out["failure"] = attempt(
        lambda: gmd.estimate_curvature(
            mlp(), nan_data, loss="mse", structure="kfac", timeout=PATIENCE
        )
    )
    out["empty"] = attempt(
        lambda: gmd.estimate_curvature(lm(), [] if RANK == 1 else data, timeout=PATIENCE)
    )
    out["examples"] = attempt(
        lambda: gmd.estimate_curvature(lm(), data, expected_examples=13, timeout=PATIENCE)
    )
    # K-FAC covers the position embedding only with one-example batches: rank 0 has those.
    pos_data = [(x[:1], y[:1]) for x, y in data] if RANK == 0 else data
    out["coverage"] = attempt(
        lambda: gmd.estimate_curvature(
            cases.position_model(), pos_data, structure="kfac", timeout=PATIENCE
        )
    )
    out["fsdp"] = attempt(lambda: gmd.estimate_curvature(fsdp_model(), data, timeout=PATIENCE))
    out["ok_after"] = attempt(
        lambda: gmd.estimate_curvature(lm(), data, structure="kfac", timeout=PATIENCE)
    )
    # The last: rank 1 comes late — only once rank 0 has waited its timeout of 1 s and left, an
    # order forced by the file rank 0 writes when its call has returned (not by a sleep, which a
    # busy machine can outlast). Rank 1 then finds rank 0 gone.
    gave_up = Path(sys.argv[2]) / "rank0-gave-up"
    while RANK == 1 and not gave_up.exists():
        time.sleep(0.05)
    out["late"] = attempt(lambda: gmd.estimate_curvature(lm(), data, timeout=1.0))
    if RANK == 0:
        gave_up.touch()
    return out


def fsdp_model() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = cases.lm_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    return model


class DiesMidway:
    """Rank 1's batches: it exits (as if killed) when asked for its second batch."""

    def __init__(self, data: list) -> None:
        self.data = data

    def __iter__(self):
        for i, batch in enumerate(self.data):
            if RANK == 1 and i == 1:
                os._exit(17)
            yield batch


def job_kill() -> dict:
    data = DiesMidway(list(gmd.shard(cases.lm_batches() * 2)))
    return {
        "kill": attempt(lambda: gmd.estimate_curvature(cases.lm_model(), data, timeout=PATIENCE))
    }


def main() -> None:
    job, outdir = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=PATIENCE))
    result = {"main": job_main, "kill": job_kill}[job]()
    torch.save(result, outdir / f"rank{RANK}.pt")
    if job != "main":  # after "late" the ranks are out of step: no collective teardown
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
