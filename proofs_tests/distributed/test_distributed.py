"""Data-parallel estimation on 2 gloo processes (CPU) against single-process estimates.

Two jobs, each bounded in time: ``main`` launched by ``torchrun`` (every structure × fisher type,
a DDP-wrapped model, the command line, every kind of bad input, a late rank), and ``kill`` (a rank
that dies mid-run). The ranks write their results (``_worker.py``); these tests compare them with
``gm.estimate_curvature`` run here on all the data.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import gradmerge as gm
from gradmerge.distributed import rank_seed, shard
from gradmerge.estimate import estimate_diagonal, estimate_kfac_factors
from proofs_tests.distributed import cases
from proofs_tests.workspace import make_workspace

WORKER = Path(__file__).with_name("_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIME_LIMIT = 1200  # seconds per job: a guard against a hang only (the ranks' own is 300 s)
pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available",
)


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; kill the whole session after TIME_LIMIT."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, **env},
        start_new_session=True,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out, _ = proc.communicate(timeout=TIME_LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd} did not finish within {TIME_LIMIT} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def _load(outdir: Path, rank: int) -> dict:
    path = outdir / f"rank{rank}.pt"
    assert path.exists(), f"rank {rank} wrote no result"
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Checkpoints and K-FAC curvature files for the merges (proofs_tests.workspace)."""
    ws = make_workspace(tmp_path_factory.mktemp("distributed-workspace"), "kfac")
    cases.write_nan_model(str(ws.root))
    ws.yaml("merge_ta.yaml", cases.MERGES["merge_ta"][1])
    return ws


@pytest.fixture(scope="module")
def main_job(tmp_path_factory, workspace):
    """The ``main`` job under ``torchrun --standalone --nproc-per-node 2``."""
    outdir = tmp_path_factory.mktemp("distributed-main")
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", str(WORKER), "main", str(outdir)]
    done = _run([*cmd, str(workspace.root)], {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-4000:]
    return outdir, [_load(outdir, 0), _load(outdir, 1)]


@pytest.fixture(scope="module")
def kill_job(tmp_path_factory):
    """The ``kill`` job: two processes started as torchrun would (rank 1 exits with status 17)."""
    outdir = tmp_path_factory.mktemp("distributed-kill")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, str(WORKER), "kill", str(outdir)]
    procs = [
        subprocess.Popen(
            cmd, cwd=ROOT, env={**os.environ, **env, "RANK": str(r)}, start_new_session=True
        )
        for r in range(2)
    ]
    try:
        codes = [p.wait(timeout=TIME_LIMIT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return codes, outdir


def _reference(
    name: str, model_fn: str, data_fn: str, options: dict
) -> gm.Curvature | torch.Tensor:
    """The single-process result on all the data; for ``fisher="mc"``, with the draws for shard r
    made by a generator seeded ``rank_seed(seed, r)`` (module docstring of gm.distributed.estimate).
    """
    model, data = cases.build(model_fn), cases.build(data_fn)
    if options["fisher"] != "mc":
        return gm.estimate_curvature(model, data, **options)
    seed = options.get("seed", 0)
    shards = [shard(data, rank=r, world_size=2) for r in range(2)]
    per_shard = [{**options, "seed": rank_seed(seed, r)} for r in range(2)]
    if options["structure"] != "kfac":  # a sum over examples: the sum of the shards' estimates
        parts = [
            gm.estimate_curvature(model, d, **o) for d, o in zip(shards, per_shard, strict=True)
        ]
        return parts[0].dense() + parts[1].dense()
    return _mc_kfac_reference(model, shards, per_shard)


def _mc_kfac_reference(model: nn.Module, shards: list, per_shard: list[dict]) -> torch.Tensor:
    """K-FAC on all the data with shard r's MC draws seeded by its rank seed: G = Σ_r G_r (the
    draws enter only G), A = Σ_r M_r A_r / Σ_r M_r, the uncovered parameters' diagonal summed.
    A, which does not depend on the draws, must also equal the A of one run on all the data."""
    kw = [{k: v for k, v in o.items() if k != "structure"} for o in per_shard]
    factors = [estimate_kfac_factors(model, d, **o) for d, o in zip(shards, kw, strict=True)]
    exact = estimate_kfac_factors(
        model, [b for d in shards for b in d], **{**kw[0], "fisher": "empirical", "mc_samples": 1}
    )
    combined = {}
    for m in factors[0].factors:
        a = sum(f.counts[m] * f.factors[m][0] for f in factors) / sum(f.counts[m] for f in factors)
        torch.testing.assert_close(a, exact.factors[m][0], rtol=1e-12, atol=1e-14)
        combined[m] = (
            torch.diag(a) if a.ndim == 1 else a,
            factors[0].factors[m][1] + factors[1].factors[m][1],
        )
    kfac = gm.KFAC(
        combined,
        bias=[m for m, b in factors[0].has_bias.items() if b],
        transposed=[m for m, t in factors[0].transposed.items() if t],
    )
    uncovered = factors[0].uncovered
    if not uncovered:
        return kfac.dense()
    diag_kw = [{k: v for k, v in o.items() if k != "kfac_approx"} for o in kw]
    diags = [
        estimate_diagonal(model, d, params=uncovered, **o)
        for d, o in zip(shards, diag_kw, strict=True)
    ]
    return gm.Blocks([kfac, diags[0] + diags[1]]).dense()


def _assert_matches(result: dict, reference: torch.Tensor) -> None:
    """Equal up to rounding: float64, sums in another order."""
    scale = float(reference.abs().max())
    torch.testing.assert_close(result["dense"], reference, rtol=1e-12, atol=1e-13 * scale)


@pytest.mark.parametrize("case", cases.CASES, ids=[c[0] for c in cases.CASES])
def test_each_structure_and_fisher_equals_the_single_process_estimate(main_job, case):
    name = case[0]
    _, ranks = main_job
    r0, r1 = ranks[0][name], ranks[1][name]
    assert torch.equal(r0["dense"], r1["dense"])  # every rank returns the same sum
    reference = _reference(*case)
    if isinstance(reference, gm.Curvature):
        assert r0["type"] == type(reference).__name__
        assert r0["layout"] == [(k, tuple(s)) for k, s in reference.layout]
        expected_meta = {**reference.meta, "ranks": "2"}
        assert r0["meta"] == expected_meta
        reference = reference.dense()
    assert r0["meta"]["num_examples"] == "12" and r0["meta"]["ranks"] == "2"
    _assert_matches(r0, reference)


def test_mc_ranks_draw_with_their_own_seeds(main_job):
    """The MC result is not the one both ranks would give drawing with the same seed."""
    _, ranks = main_job
    model, data = cases.lm_model(), cases.lm_batches()
    same_seed = sum(
        gm.estimate_curvature(model, shard(data, rank=r, world_size=2), fisher="mc").dense()
        for r in range(2)
    )
    assert not torch.allclose(ranks[0]["lm-diag-mc"]["dense"], same_seed)


def test_ddp_model_is_unwrapped_without_triggering_its_all_reduce(main_job):
    _, ranks = main_job
    for rank in ranks:
        ddp = rank["ddp"]
        assert ddp["hook_calls_after_estimates"] == 0  # DDP's comm hook never ran
        assert all(ddp["grads_after_estimates"])  # .grad untouched (None)
        for structure in ("kfac", "diag", "full"):
            plain = rank[f"lm-{structure}-empirical"]["dense"]
            torch.testing.assert_close(ddp[structure]["dense"], plain, rtol=0, atol=0)
        assert ddp["hook_calls_after_step"] >= 1  # ... and DDP still trains normally after
    # the training step's gradients are DDP's average of the two ranks' gradients
    model, data = cases.lm_model(), cases.lm_batches()
    grads = []
    for r in range(2):
        ids, targets = shard(data, rank=r, world_size=2)[0]
        model.zero_grad()
        loss = nn.functional.cross_entropy(
            model(ids).reshape(-1, cases.CLASSES), targets.reshape(-1)
        )
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        mean = (grads[0][n] + grads[1][n]) / 2
        for rank in ranks:
            torch.testing.assert_close(rank["ddp"]["grads_after_step"][n], mean)


def test_command_line_writes_the_single_process_estimate(main_job):
    outdir, ranks = main_job
    assert [r["cli_ok"]["status"] for r in ranks] == [0, 0]
    assert "on 2 ranks" in ranks[0]["cli_ok"]["stdout"]
    model, data = cases.mlp_model(), cases.mlp_batches()
    written = gm.load_curvature(outdir / "cli_ok.safetensors", like=model)
    reference = gm.estimate_curvature(model, data, structure="kfac", loss="mse")
    assert written.meta["ranks"] == "2" and written.meta["num_examples"] == "12"
    _assert_matches({"dense": written.dense()}, reference.dense())


def test_gradmerge_curvature_distributed_flag_writes_the_single_process_estimate(main_job):
    """``gradmerge curvature ... --distributed`` under torchrun: the sum over both ranks' shards."""
    outdir, ranks = main_job
    assert [r["cli_flag"]["status"] for r in ranks] == [0, 0], ranks[0]["cli_flag"]["stderr"]
    assert "on 2 ranks" in ranks[0]["cli_flag"]["stdout"]
    assert ranks[1]["cli_flag"]["stdout"] == ""  # rank 0 speaks for the job
    model, data = cases.mlp_model(), cases.mlp_batches()
    written = gm.load_curvature(outdir / "cli_flag.safetensors", like=model)
    reference = gm.estimate_curvature(model, data, structure="diag", loss="mse")
    assert isinstance(written, gm.Diagonal)
    assert written.meta["ranks"] == "2" and written.meta["num_examples"] == "12"
    _assert_matches({"dense": written.dense()}, reference.dense())


def test_command_line_failure_reports_on_every_rank_and_writes_nothing(main_job):
    outdir, ranks = main_job
    assert not (outdir / "cli_fail.safetensors").exists()
    assert not list(outdir.glob(".cli_fail*"))  # no temporary file left behind either
    for r, rank in enumerate(ranks):
        fail = rank["cli_fail"]
        assert fail["status"] == 1 and not fail["exists_after"]
        assert f"rank {r}: error:" in fail["stderr"]
        assert "rank 1: NonFiniteError" in fail["stderr"]


BAD = {  # case → what every rank's DistributedError must say
    "model": "the values of 'hidden.weight' differ",
    "options": "fisher='mc' (rank 0: 'empirical')",
    "failure": "rank 1: NonFiniteError: batch 1",
    "empty": "rank 1: ArgumentError: data is empty",
    "examples": "saw 12 examples in all (rank 0: 4, rank 1: 8), expected 13",
    "coverage": "only on rank 0: ['blocks0/kfac/pos/0/A', 'blocks0/kfac/pos/0/G']",
    "fsdp": "the model is sharded",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_the_same_error_on_every_rank(main_job, case):
    _, ranks = main_job
    outcomes = [rank[case] for rank in ranks]
    for outcome in outcomes:
        assert outcome["error"] == "DistributedError", outcome
        assert BAD[case] in outcome["message"], outcome["message"]  # an answer, not a timeout
    assert outcomes[0]["message"] == outcomes[1]["message"]


def test_a_failing_rank_is_named_and_keeps_its_exception(main_job):
    _, ranks = main_job
    failure = [rank["failure"] for rank in ranks]
    assert [set(f["failures"]) for f in failure] == [{1}, {1}]
    assert failure[0]["cause"] is None and failure[1]["cause"] == "NonFiniteError"


def test_the_group_stays_usable_after_collective_errors(main_job):
    _, ranks = main_job
    reference = gm.estimate_curvature(cases.lm_model(), cases.lm_batches(), structure="kfac")
    for rank in ranks:
        _assert_matches(rank["ok_after"]["ok"], reference.dense())


def test_a_late_rank_makes_the_others_fail_after_their_timeout(main_job):
    _, ranks = main_job
    early, late = ranks[0]["late"], ranks[1]["late"]
    assert early["error"] == late["error"] == "DistributedError"
    # rank 1 starts only once rank 0 has given up (_worker.py forces the order); a timeout cannot
    # fire early, and the message names the call's own timeout of 1 s, not the group's 300 s
    assert early["seconds"] > 0.9
    assert "timeout of 1 s" in early["message"] and "Ranks 1 failed" in early["message"]


def test_a_killed_rank_makes_the_others_fail_at_once(kill_job):
    codes, outdir = kill_job
    assert codes == [0, 17]
    assert not (outdir / "rank1.pt").exists()
    killed = _load(outdir, 0)["kill"]
    assert killed["error"] == "DistributedError"
    # noticed from the closed connection, not by the timeout of 300 s (whose message differs)
    assert "a rank crashed or was killed" in killed["message"]


# ----- distributed merging ----------------------------------------------------------------------
@pytest.mark.parametrize("name", list(cases.MERGES))
def test_distributed_merge_equals_the_single_process_merge(main_job, workspace, tmp_path, name):
    """Every tensor bit-equal to run_merge/run_remove in one process; one index over the ranks'
    shards; the record says how the units were split."""
    from gradmerge.io import open_checkpoint
    from gradmerge.jobs import run_merge, run_remove

    outdir, ranks = main_job
    assert ranks[0][name]["files"] == ranks[1][name]["files"]  # the same report on every rank
    command, config = cases.merge_config(str(workspace.root), name)
    single = (run_merge if command == "merge" else run_remove)(
        config, tmp_path / "single", progress=False
    )
    out = outdir / name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    with open_checkpoint(out) as merged, open_checkpoint(single.out_dir) as reference:
        assert merged.keys() == reference.keys()  # the base's storage order, across the shards
        assert list(index["weight_map"]) == reference.keys()
        for k in reference:
            a, b = merged.get(k), reference.get(k)
            assert a.dtype == b.dtype and torch.equal(a, b), k
    record = json.loads((out / f"gradmerge_{command}.json").read_text())
    split = record["distributed"]["units_per_rank"]
    assert record["distributed"]["ranks"] == 2 and sum(split) == single.units and min(split) > 0
    assert not list(out.parent.glob(f".{name}.gradmerge-*"))  # no staging folder left
    alone = json.loads((single.out_dir / f"gradmerge_{command}.json").read_text())
    assert record["output"]["untouched"] == alone["output"]["untouched"]  # every rank's counted
    if command == "remove":  # the step, summed over the ranks, is the single process's
        alone = json.loads((single.out_dir / "gradmerge_remove.json").read_text())["step"]
        assert record["step"]["ratio"] == pytest.approx(alone["ratio"], rel=1e-12)


def test_a_removal_step_above_its_limit_is_refused_on_every_rank(main_job):
    outdir, ranks = main_job
    for rank in ranks:
        refused = rank["remove_refused"]
        assert refused["error"] == "DistributedError" and set(refused["failures"]) == {0, 1}
        assert (
            "StepTooLargeError" in refused["message"] and "max_relative_step" in refused["message"]
        )
    assert not (outdir / "remove_refused").exists()
    assert not list(outdir.glob(".remove_refused.gradmerge-*"))


def test_a_rank_failing_during_a_merge_leaves_no_output(main_job):
    outdir, ranks = main_job
    for rank in ranks:
        fail = rank["merge_fail"]
        assert fail["error"] == "DistributedError" and set(fail["failures"]) == {1}
        assert "rank 1: NonFiniteError" in fail["message"] and "3.weight" in fail["message"]
    assert not (outdir / "merge_fail").exists()
    assert not list(outdir.glob(".merge_fail.gradmerge-*"))  # the staging folder was removed


def test_an_existing_output_is_refused_on_every_rank(main_job):
    _, ranks = main_job
    for rank in ranks:
        exists = rank["merge_exists"]
        # every rank applies the output guard before opening the inputs
        assert exists["error"] == "DistributedError"
        assert set(exists["failures"]) == set(range(len(ranks)))
        assert "OutputExistsError" in exists["message"]


def test_command_line_merge_under_torchrun(main_job):
    """``-m gradmerge.commands.distributed merge CONFIG OUT``: the same tensors as the API's merge."""
    from gradmerge.io import open_checkpoint

    outdir, ranks = main_job
    assert [r["cli_merge"]["status"] for r in ranks] == [0, 0]
    assert "task_arithmetic: wrote" in ranks[0]["cli_merge"]["stdout"]
    assert ranks[1]["cli_merge"]["stdout"] == ""  # rank 0 speaks for the job
    with open_checkpoint(outdir / "cli_merge") as cli, open_checkpoint(outdir / "merge_ta") as api:
        assert cli.keys() == api.keys()
        assert all(torch.equal(cli.get(k), api.get(k)) for k in api)
