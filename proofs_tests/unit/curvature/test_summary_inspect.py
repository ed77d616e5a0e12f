"""`gradmerge inspect` and gradmerge.curvature.summary against values computed directly.

References: numpy.quantile on the explicit diagonal, the diagonal of the dense matrix a curvature
forms (C.dense()), numpy's eigvalsh of each K-FAC factor, and gm.gradient_matching itself for the
mixing identity behind the δ window.
"""

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradmerge as gm
from gradmerge.cli import main
from gradmerge.curvature import summary
from gradmerge.curvature.summary import delta_window, diagonal_values, scale_of


def _psd(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n + 2, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x.T @ x / (n + 2)


def _curvatures():
    kfac = gm.KFAC(
        {
            "fc": [(_psd(4, 0), _psd(3, 1)), (_psd(4, 2), _psd(3, 3))],
            "conv": (_psd(2, 4), _psd(5, 5)),
        },
        bias=["fc"],
        transposed=["conv"],
    )
    diag = gm.Diagonal({"n.weight": torch.tensor([0.0, 1.5, 2.0, 0.0], dtype=torch.float64)})
    dense = gm.Dense(_psd(6, 6), {"d.weight": torch.zeros(2, 3, dtype=torch.float64)})
    return {"kfac": kfac, "diag": diag, "dense": dense, "blocks": gm.Blocks([kfac, diag])}


@pytest.mark.parametrize("name", ["kfac", "diag", "dense", "blocks"])
def test_diagonal_values_equal_the_dense_diagonal(name):
    c = _curvatures()[name]
    got = diagonal_values(c)
    flat = torch.cat([got[k].reshape(-1) for k, _ in c.layout])
    torch.testing.assert_close(flat, c.dense().diagonal(), rtol=1e-12, atol=1e-14)


def test_lazy_sum_diagonal_is_the_sum_of_its_terms():
    c = _curvatures()["kfac"] + gm.Diagonal(
        {k: torch.rand(s, dtype=torch.float64) for k, s in _curvatures()["kfac"].layout}
    )
    got = diagonal_values(c + 0.5)
    flat = torch.cat([got[k].reshape(-1) for k, _ in c.layout])
    torch.testing.assert_close(flat, (c + 0.5).dense().diagonal(), rtol=1e-12, atol=1e-14)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.floats(0, 1e6), min_size=1, max_size=30), min_size=1, max_size=4))
def test_scale_equals_numpy_quantiles(groups):
    tensors = [torch.tensor(g, dtype=torch.float64) for g in groups]
    everything = np.concatenate([np.array(g) for g in groups])
    s = scale_of(tensors)
    for key, q in summary.PERCENTILES.items():
        assert s.percentiles[key] == float(np.quantile(everything, q))  # exactly
    assert s.zeros == pytest.approx(float(np.mean(everything == 0)))
    positive = everything[everything > 0]
    assert s.min_positive == (float(positive.min()) if positive.size else None)
    assert s.entries == everything.size


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.floats(-8, 8))
def test_gradient_matching_is_the_shared_mix_of_task_arithmetic_and_fisher_averaging(
    seed, tasks, log_delta
):
    """The identity the δ window rests on, checked against gm.gradient_matching."""
    g = torch.Generator().manual_seed(seed)
    n, delta = 50, 10.0**log_delta
    hs = [
        torch.rand(n, generator=g, dtype=torch.float64)
        * 10.0 ** torch.randint(-3, 4, (n,), generator=g)
        for _ in range(tasks)
    ]
    alphas = (torch.rand(tasks, generator=g, dtype=torch.float64) + 0.5).tolist()
    base = {"w": torch.zeros(n, dtype=torch.float64)}
    taus = [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(tasks)]
    merged = gm.gradient_matching(
        base,
        [{"w": t} for t in taus],
        [gm.Diagonal({"w": h}) for h in hs],
        prior=delta,
        alphas=alphas,
    )["w"]
    total = sum(a * h for a, h in zip(alphas, hs, strict=True))
    share = delta / (delta + total)
    ta = sum(a * t for a, t in zip(alphas, taus, strict=True))
    fa = sum(a * h * t for a, h, t in zip(alphas, hs, taus, strict=True)) / total
    torch.testing.assert_close(merged, share * ta + (1 - share) * fa, rtol=1e-9, atol=1e-12)


def test_delta_window_bounds_the_share_on_the_middle_coordinates():
    h = torch.tensor(np.logspace(-2, 3, 1001))
    rho = 1e-3
    low, high = delta_window(h, rho=rho)
    p10, p90 = float(np.quantile(h.numpy(), 0.1)), float(np.quantile(h.numpy(), 0.9))
    middle = h[(h >= p10) & (h <= p90)]
    for delta in (low, high, math.sqrt(low * high)):
        share = delta / (delta + middle)
        assert float(share.min()) >= rho * (1 - 1e-12) and float(share.max()) <= (1 - rho) * (
            1 + 1e-12
        )
    assert float((low / (low + middle)).min()) == pytest.approx(rho, rel=1e-9)  # tight at p90
    assert float((high / (high + middle)).max()) == pytest.approx(1 - rho, rel=1e-9)  # at p10
    lo_wide, hi_wide = delta_window(torch.tensor([1e-6, 1e6] * 50))
    assert lo_wide > hi_wide  # a span above ((1 − ρ)/ρ)² leaves no window
    with pytest.raises(gm.ArgumentError, match="no positive entry"):
        delta_window(torch.zeros(3))


def test_inspect_cli_numbers_equal_direct_computation(tmp_path, capsys):
    cs = _curvatures()
    a = cs["blocks"]
    a.meta["num_examples"] = "120"
    a.save(tmp_path / "a.safetensors")
    b = gm.Diagonal({k: torch.rand(s, dtype=torch.float64) + 0.1 for k, s in a.layout})
    b.save(tmp_path / "b.safetensors")
    assert (
        main(
            [
                "inspect",
                str(tmp_path / "a.safetensors"),
                str(tmp_path / "b.safetensors"),
                "--json",
                "-",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    fa, fb = report["files"]
    assert fa["num_examples"] == 120 and fb["num_examples"] is None
    assert fa["structure"] == "blocks" and fb["structure"] == "diag"
    dense_a = a.dense().diagonal().numpy()
    for key, q in summary.PERCENTILES.items():
        assert fa["scale"][key] == float(np.quantile(dense_a, q))  # exact order statistics
    assert fa["scale"]["zeros"] == pytest.approx(2 / dense_a.size)
    layer = next(x for x in fa["layers"] if x["keys"] == ["fc.weight", "fc.bias"])
    for (am, gm_), got in zip(cs["kfac"].terms["fc"], layer["factors"]["fc"], strict=True):
        ea, eg = np.linalg.eigvalsh(am.numpy()), np.linalg.eigvalsh(gm_.numpy())
        assert got["a_min"] == pytest.approx(ea[0], rel=1e-6) and got["a_max"] == pytest.approx(
            ea[-1], rel=1e-6
        )
        assert got["g_min"] == pytest.approx(eg[0], rel=1e-6) and got["g_max"] == pytest.approx(
            eg[-1], rel=1e-6
        )
    total = dense_a + b.dense().diagonal().numpy()  # same layout order
    positive = total[total > 0]
    w = report["delta_window"]
    assert w["low"] == 1e-3 / (1 - 1e-3) * np.quantile(positive, 0.9)
    assert w["high"] == (1 - 1e-3) / 1e-3 * np.quantile(positive, 0.1)
    # the text form prints the same window
    assert main(["inspect", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]) == 0
    text = capsys.readouterr().out
    assert f"[{w['low']:.3g}, {w['high']:.3g}]" in text and "num_examples 120" in text


@pytest.mark.parametrize("span", [1e2, 1e8])
def test_the_reported_window_is_ordered_or_empty_never_inverted(tmp_path, capsys, span):
    """Entries spanning more than ((1 − ρ)/ρ)² ≈ 1e6 between p10 and p90 leave no δ window: the
    JSON says empty with no ends (its two bounds under their own names, the first above the
    second), the text says empty; a narrower span gives low ≤ high, in the JSON and the text."""
    values = torch.tensor(np.geomspace(1.0, span, 101))
    gm.Diagonal({"w": values}).save(tmp_path / "a.safetensors")
    args = ["inspect", str(tmp_path / "a.safetensors")]
    assert main([*args, "--json", "-"]) == 0
    w = json.loads(capsys.readouterr().out)["delta_window"]
    lower = 1e-3 / (1 - 1e-3) * float(np.quantile(values.numpy(), 0.9))
    upper = (1 - 1e-3) / 1e-3 * float(np.quantile(values.numpy(), 0.1))
    assert w["not_fisher_from"] == pytest.approx(lower, rel=1e-12)
    assert w["not_arithmetic_up_to"] == pytest.approx(upper, rel=1e-12)
    assert main(args) == 0
    text = capsys.readouterr().out
    if span > 1e6:
        assert lower > upper and w["empty"] and w["low"] is None and w["high"] is None
        assert "δ window for the file: empty" in text
    else:
        assert not w["empty"] and w["low"] <= w["high"]
        assert (w["low"], w["high"]) == (w["not_fisher_from"], w["not_arithmetic_up_to"])
        assert f"[{w['low']:.3g}, {w['high']:.3g}]" in text


def test_inspect_bad_file_is_one_error_line(tmp_path, capsys):
    (tmp_path / "x.safetensors").write_bytes(b"not a file")
    assert main(["inspect", str(tmp_path / "x.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gradmerge inspect: error:") and err.count("\n") == 1
