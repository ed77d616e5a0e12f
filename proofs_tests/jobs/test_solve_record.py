"""The K-FAC merge record: every solved layer's method, CG iterations and relative residual are in
gradmerge_merge.json (and the report), and the recorded residual is the true one — recomputed
here from the dense matrices of H̄ = δI + Σ_t α_t A_t ⊗ G_t and the merged weights written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import gradmerge as gm
from proofs_tests.workspace import make_workspace

DT = torch.float64


def _matrix(params, layer):
    return torch.cat([params[f"{layer}.weight"], params[f"{layer}.bias"][:, None]], 1).to(DT)


@pytest.mark.parametrize("tasks", [1, 3])
def test_recorded_residuals_equal_dense_residuals(tmp_path, tasks):
    ws = make_workspace(tmp_path, "kfac", tasks=tasks, dtype=DT, curvature_dtype=DT)
    alphas, delta = [1.0, 0.5, 0.8][:tasks], 1e-3
    config = ws.merge_dict(prior={"delta": delta}, compute_dtype="float64", dtype="float64")
    for model, alpha in zip(config["models"], alphas, strict=True):
        model["alpha"] = alpha
    cfg = ws.yaml("m.yaml", config)
    report = gm.run_merge(gm.MergeConfig.from_yaml(cfg), tmp_path / "out")
    record = json.loads((tmp_path / "out" / "gradmerge_merge.json").read_text())
    merged = load_file(tmp_path / "out" / "model.safetensors")
    base = ws.load(ws.base, DT)
    fts = [ws.load(m, DT) for m in ws.models]
    kfacs = [ws.curvature(c, DT) for c in ws.curvatures]
    kfacs = [next(b for b in k.blocks if isinstance(b, gm.KFAC)) for k in kfacs]
    layers = sorted(kfacs[0].terms)
    assert sorted(record["solves"]) == layers and report.solves == record["solves"]
    for layer in layers:
        x = (_matrix(merged, layer) - _matrix(base, layer)).reshape(-1)
        n = x.numel()
        dense = [sum(torch.kron(g, a) for a, g in k.terms[layer]) for k in kfacs]
        hbar = delta * torch.eye(n, dtype=DT) + sum(
            a * d for a, d in zip(alphas, dense, strict=True)
        )
        b = sum(
            a
            * (d + delta * torch.eye(n, dtype=DT))
            @ (_matrix(ft, layer) - _matrix(base, layer)).reshape(-1)
            for a, d, ft in zip(alphas, dense, fts, strict=True)
        )
        true = float(torch.linalg.norm(b - hbar @ x) / torch.linalg.norm(b))
        entry = record["solves"][layer]
        assert entry["residual"] <= 1e-10 and true <= 1e-9
        # the recorded residual is x's before adding θ_LLM; the written weights add the
        # round-off of that sum (relative ε₆₄·‖θ_LLM‖/‖x‖), far below the tolerance
        assert entry["residual"] == pytest.approx(true, abs=1e-11)
        assert (entry["iterations"] == 0) == (tasks == 1)
    assert record["max_residual"] == max(e["residual"] for e in record["solves"].values())


def test_cli_prints_the_largest_residual(tmp_path, capsys):
    from gradmerge.cli import main

    ws = make_workspace(tmp_path, "kfac", tasks=2)
    cfg = ws.yaml("m.yaml", ws.merge_dict())
    assert main(["merge", str(cfg), str(tmp_path / "out"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "out" / "gradmerge_merge.json").read_text())
    assert f"largest relative residual {record['max_residual']:.1e}" in out
    assert 0 < record["max_residual"] <= 1e-5  # float32 compute: certified to 1e-5


def _three_task_config(ws, **extra):
    return ws.merge_dict(prior={"delta": 1e-3}, **extra)


def test_solver_keys_set_every_k_fac_solve(tmp_path):
    """`solver: {tol, maxiter}`: a tighter tolerance shows in the recorded residuals; a budget
    of one CG iteration with a tolerance CG cannot meet in it is a NotConvergedError naming the
    layer and the YAML fix, and no output folder is left."""
    ws = make_workspace(tmp_path, "kfac", tasks=3)
    tight = ws.yaml("tight.yaml", _three_task_config(ws, solver={"tol": 1e-7}))
    gm.run_merge(gm.MergeConfig.from_yaml(tight), tmp_path / "tight")
    record = json.loads((tmp_path / "tight" / "gradmerge_merge.json").read_text())
    assert record["config"]["solver"]["tol"] == 1e-7
    assert all(e["residual"] <= 1e-7 for e in record["solves"].values())
    starved = ws.yaml("starved.yaml", _three_task_config(ws, solver={"tol": 1e-9, "maxiter": 1}))
    config = gm.MergeConfig.from_yaml(starved)
    assert config.solver.maxiter == 1
    with pytest.raises(gm.NotConvergedError, match=r"prior: \{delta"):
        gm.run_merge(config, tmp_path / "starved")
    assert not (tmp_path / "starved").exists()


@pytest.mark.parametrize(
    ("solver", "message"),
    [
        ({"tol": 0}, "solver.tol"),
        ({"tol": 2.0}, "solver.tol"),
        ({"tol": "x"}, "solver.tol"),
        ({"maxiter": 0}, "solver.maxiter"),
        ({"maxiter": -1, "approximate": True}, "solver.maxiter"),
        ({"approximate": "yes"}, "solver.approximate"),
        ({"maxiter": 2.5}, "solver.maxiter"),
        ({"iterations": 5}, "unknown key 'iterations'"),
        ({"arithmetic": "float16"}, "solver.arithmetic"),
        # the key of gradmerge 0.1.0, named with its replacement and the value to keep
        (
            {"precision": "bfloat16"},
            r"`solver.precision` is `solver.arithmetic`.*arithmetic='bfloat16'",
        ),
        ("fast", "solver must be a mapping"),
    ],
)
def test_bad_solver_keys_are_config_errors(tmp_path, solver, message):
    ws = make_workspace(tmp_path, "kfac", tasks=1)
    path = ws.yaml("bad.yaml", _three_task_config(ws, solver=solver))
    with pytest.raises(gm.ConfigError, match=message):
        gm.MergeConfig.from_yaml(path)


def test_approximate_solver_records_unmet_residuals_and_the_cli_says_so(tmp_path, capsys):
    """`solver: {approximate: true}` (maxiter 0: the eigenbasis preconditioner alone): the merge
    succeeds, each layer's true residual is recorded with ``success: false`` where it is above
    tol, the CLI says how many systems stopped short, and with a CG budget the same merge gets
    closer to the certified one."""
    from gradmerge.cli import main

    ws = make_workspace(tmp_path, "kfac", tasks=3)
    exact = ws.yaml("exact.yaml", _three_task_config(ws, solver={"tol": 1e-6}))
    gm.run_merge(gm.MergeConfig.from_yaml(exact), tmp_path / "exact")
    approx = ws.yaml("a.yaml", _three_task_config(ws, solver={"tol": 1e-6, "approximate": True}))
    config = gm.MergeConfig.from_yaml(approx)
    assert config.solver.approximate and config.solver.maxiter == 0
    assert main(["merge", str(approx), str(tmp_path / "approx"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "approx" / "gradmerge_merge.json").read_text())
    assert record["config"]["solver"]["approximate"] is True
    short = [e for e in record["solves"].values() if not e["success"]]
    assert short and all(e["residual"] > 1e-6 and e["iterations"] == 0 for e in short)
    assert all(e["residual"] <= 1e-6 for e in record["solves"].values() if e["success"])
    assert f"{len(short)} of {len(record['solves'])} systems stopped above solver.tol" in out
    budget = ws.yaml(
        "b.yaml", _three_task_config(ws, solver={"tol": 1e-6, "approximate": True, "maxiter": 3})
    )
    gm.run_merge(gm.MergeConfig.from_yaml(budget), tmp_path / "budget")
    merged = {
        name: load_file(tmp_path / name / "model.safetensors")
        for name in ("exact", "approx", "budget")
    }
    err = {
        name: sum(float((m[k].double() - merged["exact"][k].double()).norm()) for k in m)
        for name, m in merged.items()
    }
    assert 0 < err["budget"] < err["approx"]
