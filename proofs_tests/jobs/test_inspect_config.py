"""`gradmerge inspect CONFIG.yaml` against a dense computation of the merge's H̄ on a tiny model.

The YAML has everything that changes H̄ = δI + s·C_0 + Σ_t α_t·scale_t·H_t: per-model α and
`scale: N/n`, the merge's global `scale`, a prior curvature with its own scale and δ; K-FAC
curvatures (one model's on a diagonal, so some units are lazy sums with bounds only). The
reference reads every curvature whole, forms each one's dense matrix (C.dense()), sums them with
the YAML's weights, and takes each unit's block: its eigenvalues (numpy.linalg.eigvalsh) against
the reported conditioning, its diagonal against the δ window and the prior's share
(numpy.percentile).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import gradmerge as gm
from gradmerge import cli
from gradmerge.jobs import MergeConfig
from gradmerge.jobs.inspection import inspect_config
from proofs_tests.workspace import _estimate, data, finetune, make_workspace, mlp

RHO = 1e-3
DELTA, PRIOR_SCALE, ALPHAS, SCALES, GLOBAL = 0.05, 2.0, (0.7, 1.3), (4.0, 0.5), 0.8


@pytest.fixture(scope="module", params=["kfac", "mixed"])
def merge(request, tmp_path_factory):
    ws = make_workspace(tmp_path_factory.mktemp("inspect-config"), "kfac")
    if request.param == "mixed":  # model 1's curvature diagonal: K-FAC + diagonal sums
        diag = _estimate(finetune(mlp(0), seed=11), data(101), "diag", "empirical", torch.float32)
        diag.save(ws.root / "ft1.curvature.safetensors")
    config = ws.merge_dict(
        scale=GLOBAL,
        prior={"delta": DELTA, "curvature": ws.base_curvature.name, "scale": PRIOR_SCALE},
    )
    for m, alpha, scale in zip(config["models"], ALPHAS, SCALES, strict=True):
        m.update(alpha=alpha, scale=scale)
    path = ws.yaml("merge.yaml", config)
    return ws, path, ws.curvatures, request.param


def _dense(ws, files):
    """H̄ and its parts as dense float64 matrices over the base's parameters, and that order."""
    layout = tuple((k, v.shape) for k, v in ws.load(ws.base, torch.float64).items())
    parts = [
        a * GLOBAL * s * gm.load_curvature(f).to(dtype=torch.float64).dense(layout).numpy()
        for f, a, s in zip(files, ALPHAS, SCALES, strict=True)
    ]
    h = sum(parts)
    c = (
        PRIOR_SCALE
        * gm.load_curvature(ws.base_curvature).to(dtype=torch.float64).dense(layout).numpy()
    )
    offsets = dict(
        zip([k for k, _ in layout], np.cumsum([0] + [s.numel() for _, s in layout]), strict=False)
    )
    index = {k: np.arange(offsets[k], offsets[k] + s.numel()) for k, s in layout}
    return h, c, index


def test_conditioning_of_every_unit_is_the_dense_block_spectrum(merge):
    ws, path, files, kind = merge
    report = inspect_config(MergeConfig.from_yaml(path))
    h, c, index = _dense(ws, files)
    hbar = DELTA * np.eye(h.shape[0]) + c + h
    assert len(report["units"]) == len(ws.load(ws.base)) - 2  # two K-FAC layers: weight+bias
    exact = 0
    for unit in report["units"]:
        rows = np.concatenate([index[k] for k in unit["keys"]])
        others = np.setdiff1d(np.arange(h.shape[0]), rows)
        assert np.abs(hbar[np.ix_(rows, others)]).max(initial=0) == 0  # units are not coupled
        eig = np.linalg.eigvalsh(hbar[np.ix_(rows, rows)])
        if unit["exact"]:
            exact += 1
            assert unit["min_eigenvalue"] == pytest.approx(eig[0], rel=1e-9)
            assert unit["max_eigenvalue"] == pytest.approx(eig[-1], rel=1e-9)
            assert unit["condition"] == pytest.approx(eig[-1] / eig[0], rel=1e-9)
        else:  # Weyl bounds: λ_min from below, λ_max from above
            assert unit["min_eigenvalue"] <= eig[0] * (1 + 1e-9)
            assert unit["max_eigenvalue"] >= eig[-1] * (1 - 1e-9)
            assert unit["condition"] >= eig[-1] / eig[0] * (1 - 1e-9)
    if kind == "mixed":  # the LayerNorm's diagonals exact, K-FAC + diagonal sums bounded
        assert 0 < exact < len(report["units"])
    else:  # multi-term K-FAC layers this small are solved exactly
        assert exact == len(report["units"])
        assert all("factors" in u for u in report["units"] if u["structure"] == "KFAC")


def test_delta_window_and_prior_share_are_those_of_the_dense_diagonal(merge):
    ws, path, files, _kind = merge
    report = inspect_config(MergeConfig.from_yaml(path), rho=RHO)
    h, c, _ = _dense(ws, files)
    hd, cd = np.diag(h), np.diag(c)
    positive = hd > 0
    low = np.percentile(RHO / (1 - RHO) * hd[positive] - cd[positive], 90)
    high = np.percentile((1 - RHO) / RHO * hd[positive] - cd[positive], 10)
    share = (DELTA + cd[positive]) / (DELTA + cd[positive] + hd[positive])
    got = report["prior_share"]
    assert got["not_fisher_from"] == pytest.approx(max(low, 0.0), rel=1e-9, abs=1e-300)
    assert got["not_arithmetic_up_to"] == pytest.approx(high, rel=1e-9)
    assert got["empty"] == (max(low, 0.0) > high)  # an empty window has no ends, never inverted
    assert (got["low"], got["high"]) == (
        (None, None) if got["empty"] else (got["not_fisher_from"], got["not_arithmetic_up_to"])
    )
    assert got["coordinates"] == int(positive.sum())
    for key, q in (("min", 0), ("p10", 10), ("p50", 50), ("p90", 90), ("max", 100)):
        assert got["share"][key] == pytest.approx(float(np.percentile(share, q)), rel=1e-9)
    assert got["fisher_like"] == int((share < RHO).sum())
    assert got["arithmetic_like"] == int((share > 1 - RHO).sum())
    # inside the window, the share is in [ρ, 1 − ρ] on at least 80% of the coordinates
    if not got["empty"]:
        for delta in (got["low"], got["high"]):
            s = (delta + cd[positive]) / (delta + cd[positive] + hd[positive])
            assert ((s >= RHO * (1 - 1e-9)) & (s <= (1 - RHO) * (1 + 1e-9))).mean() >= 0.8 - 1e-12
    assert report["models"][0]["scale"] == SCALES[0]
    assert report["models"][1]["alpha"] == pytest.approx(GLOBAL * ALPHAS[1])
    assert report["prior"] == {
        "delta": DELTA,
        "scale": PRIOR_SCALE,
        "curvature": [str(ws.base_curvature)],
    }


def test_cli_prints_the_window_and_the_worst_units(merge, capsys):
    _, path, _, _ = merge
    assert cli.main(["inspect", str(path), "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert cli.main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    w = report["prior_share"]
    lower, upper = w["not_fisher_from"], w["not_arithmetic_up_to"]
    assert f"{lower:.3g}" in text and f"{upper:.3g}" in text
    assert "worst conditioned" in text and "prior share s" in text


def test_a_config_with_other_paths_or_a_method_without_a_system_is_refused(merge, capsys, tmp_path):
    ws, path, files, _kind = merge
    assert cli.main(["inspect", str(path), str(files[0])]) == 1
    assert "one merge CONFIG" in capsys.readouterr().err
    ta = ws.yaml(
        "ta.yaml",
        {
            "method": "task_arithmetic",
            "base_model": ws.base.name,
            "models": [{"model": m.name} for m in ws.models],
        },
    )
    assert cli.main(["inspect", str(ta)]) == 1
    assert "solves no curvature system" in capsys.readouterr().err
