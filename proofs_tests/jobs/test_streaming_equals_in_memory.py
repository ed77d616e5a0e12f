"""A streamed merge or removal equals the gm.* rule applied to whole state dicts in memory.

For every method and curvature structure (diagonal, K-FAC with a diagonal block for the rest,
dense), the engine reads one coupling group at a time; since no structure couples two groups,
the result is the same computation, and it is compared exactly (no tolerance) in float32.
"""

import pytest
import torch
from safetensors.torch import load_file

import gradmerge as gm
from gradmerge.jobs import MergeConfig, RemoveConfig, run_merge, run_remove
from proofs_tests.workspace import assert_same, make_workspace

ALPHAS = [0.7, 0.4]


@pytest.fixture(scope="module", params=["diag", "kfac", "full"])
def ws(request, tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp(request.param), request.param)


def _merged(ws, config, out):
    cfg = MergeConfig.from_dict(config, root=ws.root)
    report = run_merge(cfg, out, progress=False)
    assert report.tensors == len(load_file(ws.base))
    return load_file(out / "model.safetensors")


def _models(ws, curvature=True):
    return [
        {"model": m.name, "alpha": a, **({"curvature": c.name} if curvature else {})}
        for m, c, a in zip(ws.models, ws.curvatures, ALPHAS, strict=True)
    ]


def test_task_arithmetic(ws, tmp_path):
    out = _merged(
        ws,
        {
            "method": "task_arithmetic",
            "base_model": "base.safetensors",
            "models": _models(ws, False),
            "scale": 0.5,
        },
        tmp_path / "out",
    )
    base, fts = ws.load(ws.base), [ws.load(m) for m in ws.models]
    assert_same(out, gm.task_arithmetic(base, fts, alphas=[0.5 * a for a in ALPHAS]))


def test_fisher_average(ws, tmp_path):
    out = _merged(
        ws,
        {"method": "fisher_average", "models": _models(ws), "damping": 1e-3},
        tmp_path / "out",
    )
    fts = [ws.load(m) for m in ws.models]
    hs = [ws.curvature(c) + 1e-3 for c in ws.curvatures]
    assert_same(out, gm.fisher_average(fts, hs, alphas=ALPHAS))


def test_gradient_matching(ws, tmp_path):
    prior = {"delta": 1e-2, "curvature": "base.curvature.safetensors", "scale": 0.5}
    out = _merged(
        ws,
        {
            "method": "gradient_matching",
            "base_model": "base.safetensors",
            "models": _models(ws),
            "prior": prior,
        },
        tmp_path / "out",
    )
    base, fts = ws.load(ws.base), [ws.load(m) for m in ws.models]
    hs = [ws.curvature(c) for c in ws.curvatures]
    h0 = 0.5 * ws.curvature(ws.base_curvature) + 1e-2
    expected = gm.gradient_matching(base, fts, hs, prior=h0, alphas=ALPHAS)
    assert_same(out, expected)
    # and the merge moved: it is not task arithmetic
    ta = gm.task_arithmetic(base, fts, alphas=ALPHAS)
    assert max(float((expected[k] - ta[k]).abs().max()) for k in ta) > 1e-3


@pytest.mark.parametrize("off_diagonal", [None, 1.0, 0.0])
def test_regmean_uses_the_kfac_input_factors(ws, tmp_path, off_diagonal):
    config = {"method": "regmean", "models": _models(ws)}
    if off_diagonal is not None:
        config["off_diagonal"] = off_diagonal
    if ws.structure != "kfac":
        with pytest.raises(gm.StructureError, match=r"holds no K-FAC layers.*structure='kfac'"):
            _merged(ws, config, tmp_path / "out")
        assert not (tmp_path / "out").exists()
        return
    out = _merged(ws, config, tmp_path / "out")
    fts = [ws.load(m) for m in ws.models]
    grams = []
    for path in ws.curvatures:
        c = gm.load_curvature(path)
        kfac = next(b for b in c.blocks if isinstance(b, gm.KFAC))
        n = int(c.meta["num_examples"])
        grams.append({m: n * _weight_inputs(kfac, m) for m in kfac.terms})
    r = gm.merge.REGMEAN_OFF_DIAGONAL if off_diagonal is None else off_diagonal  # YAML default
    expected = gm.regmean(fts, grams, alphas=ALPHAS, off_diagonal=r)  # biases averaged
    assert_same(out, expected)
    # the LayerNorm (no K-FAC factor) is the α-weighted average, as in RegMean
    w = sum(a * ft["2.weight"] for a, ft in zip(ALPHAS, fts, strict=True)) / sum(ALPHAS)
    torch.testing.assert_close(out["2.weight"], w)


def _removed(ws, config, out):
    report = run_remove(RemoveConfig.from_dict(config, root=ws.root), out, progress=False)
    assert report.merged == len(ws.load(ws.base))
    return load_file(out / "model.safetensors")


def test_remove_eq13(ws, tmp_path):
    remaining = {"delta": 1e-1, "curvature": "base.curvature.safetensors"}
    out = _removed(
        ws,
        {
            "method": "remove",
            "base_model": "base.safetensors",
            "model": "ft0.safetensors",
            "curvature": "ft0.curvature.safetensors",
            "prior": {"delta": 1e-2},
            "remaining": remaining,
            "alpha": 0.5,
            "step_check": "ignore",  # random curvatures: steps up to 149× the task vector
        },
        tmp_path / "out",
    )
    base, ft = ws.load(ws.base), ws.load(ws.models[0])
    rest = ws.curvature(ws.base_curvature) + 1e-1
    expected = gm.remove(
        base, ft, ws.curvature(ws.curvatures[0]), remaining=rest, prior=1e-2, alpha=0.5
    )
    assert_same(out, expected)


def test_influence_remove(ws, tmp_path):
    out = _removed(
        ws,
        {
            "method": "influence_remove",
            "base_model": "base.safetensors",
            "gradient": "gradient.safetensors",
            "remaining": {"delta": 1e-1, "curvature": "base.curvature.safetensors", "scale": 2.0},
            "step_check": "ignore",  # a random gradient: steps up to 33× the weights
        },
        tmp_path / "out",
    )
    base, grad = ws.load(ws.base), ws.load(ws.gradient)
    rest = 2.0 * ws.curvature(ws.base_curvature) + 1e-1
    assert_same(out, gm.influence_remove(base, grad, remaining=rest))


def test_tasks_with_different_structures(tmp_path):
    """Task 0 with K-FAC (+ a diagonal block), task 1 with a diagonal: a unit is a K-FAC layer,
    and the diagonal's part of it joins the K-FAC term. No structure holds K-FAC + diagonal
    exactly, so both paths solve that sum by CG: per layer when streaming, over all layers at once
    in memory. They agree to CG's tolerance (1e-10 in float64)."""
    f64 = torch.float64  # float64 curvatures: a float32 estimate's round-off (eigenvalues of
    # −1e-7) fails the PSD check once cast to float64
    kfac = make_workspace(tmp_path / "kfac", "kfac", curvature_dtype=f64)
    diag = make_workspace(tmp_path / "diag", "diag", curvature_dtype=f64)
    config = {
        "method": "gradient_matching",
        "base_model": str(kfac.base),
        "models": [
            {"model": str(kfac.models[0]), "curvature": str(kfac.curvatures[0])},
            {"model": str(kfac.models[1]), "curvature": str(diag.curvatures[1])},
        ],
        "prior": {"delta": 1e-2},
        "compute_dtype": "float64",
        "dtype": "float64",
    }
    run_merge(MergeConfig.from_dict(config), tmp_path / "out", progress=False)
    out = load_file(tmp_path / "out" / "model.safetensors")
    base, fts = kfac.load(kfac.base, f64), [kfac.load(m, f64) for m in kfac.models]
    hs = [kfac.curvature(kfac.curvatures[0], f64), diag.curvature(diag.curvatures[1], f64)]
    expected = gm.gradient_matching(base, fts, hs, prior=1e-2)
    assert_same(out, expected, rtol=1e-8, atol=1e-10)


SCALES = [3.0, 0.25]  # models[t].scale: H_t = scale × the file (N/n for a subsample's sum)


def _scaled_models(ws):
    return [{**m, "scale": s} for m, s in zip(_models(ws), SCALES, strict=True)]


@pytest.mark.parametrize("method", ["fisher_average", "gradient_matching"])
def test_per_model_scale_multiplies_the_curvature(ws, tmp_path, method):
    config = {"method": method, "models": _scaled_models(ws), "base_model": "base.safetensors"}
    if method == "gradient_matching":
        config["prior"] = {"delta": 1e-2}
    else:
        config["damping"] = 1e-3
    out = _merged(ws, config, tmp_path / "out")
    base, fts = ws.load(ws.base), [ws.load(m) for m in ws.models]
    hs = [s * ws.curvature(c) for s, c in zip(SCALES, ws.curvatures, strict=True)]
    if method == "fisher_average":
        expected = gm.fisher_average(fts, [h + 1e-3 for h in hs], alphas=ALPHAS)
    else:
        expected = gm.gradient_matching(base, fts, hs, prior=1e-2, alphas=ALPHAS)
    assert_same(out, expected)
    plain = _merged(ws, {**config, "models": _models(ws)}, tmp_path / "plain")
    assert max(float((plain[k] - out[k]).abs().max()) for k in expected) > 1e-4  # it mattered


def _weight_inputs(kfac, m):
    """Layer m's input factor A without its bias column (RegMean averages biases)."""
    a = kfac.terms[m][0][0]
    return a[:-1, :-1] if m in kfac.bias else a


def test_per_model_scale_multiplies_regmean_grams(ws, tmp_path):
    if ws.structure != "kfac":
        return
    out = _merged(ws, {"method": "regmean", "models": _scaled_models(ws)}, tmp_path / "out")
    fts = [ws.load(m) for m in ws.models]
    grams = []
    for s, path in zip(SCALES, ws.curvatures, strict=True):
        c = gm.load_curvature(path)
        kfac = next(b for b in c.blocks if isinstance(b, gm.KFAC))
        n = int(c.meta["num_examples"])
        grams.append({m: (s * n) * _weight_inputs(kfac, m) for m in kfac.terms})
    expected = gm.regmean(fts, grams, alphas=ALPHAS)  # Jin et al.'s r, biases averaged
    assert_same(out, expected)


def test_per_model_scale_must_be_positive(ws):
    for bad in (0, -1.0, "x"):
        models = [{**m, "scale": bad} for m in _models(ws)]
        with pytest.raises(gm.ConfigError, match=r"models\[0\]\.scale"):
            MergeConfig.from_dict({"method": "fisher_average", "models": models}, root=ws.root)
    with pytest.raises(gm.ConfigError, match=r"scale.*not used by method task_arithmetic"):
        MergeConfig.from_dict(
            {
                "method": "task_arithmetic",
                "base_model": "base.safetensors",
                "models": [{"model": "ft0.safetensors", "scale": 2.0}],
            },
            root=ws.root,
        )
