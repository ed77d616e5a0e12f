"""Exact order statistics in bounded memory (gradmerge.curvature.quantiles) against
numpy.percentile on the concatenated values, and `gradmerge inspect` on random curvature files
(diagonal float32, float64, K-FAC) against numpy.percentile on the entries read back whole.

Small GATHER and CHUNK make tiny inputs take every path the real sizes take: histograms split
over several passes, ties resolved early, chunked tensors.
"""

import json
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradmerge as gm
from gradmerge.cli import main
from gradmerge.curvature import quantiles
from gradmerge.curvature.quantiles import OrderStatistics, order_statistics, sort_keys
from gradmerge.curvature.summary import PERCENTILES

PCT = {k: 100 * q for k, q in PERCENTILES.items()}


def _values(kind: int, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == 0:
        return rng.standard_normal(n)
    if kind == 1:  # positive, spread over sixty decades like curvature entries
        return rng.random(n) * 10.0 ** rng.integers(-30, 30, n).astype(np.float64)
    if kind == 2:  # 40% exact zeros
        return np.where(rng.random(n) < 0.4, 0.0, rng.random(n))
    if kind == 3:  # one value repeated (a tie filling whole buckets), signed zeros included
        return np.full(n, rng.choice([0.0, -0.0, 1.5, -2.0, 1e-300]))
    return 1.0 + rng.integers(0, 3, n) * np.finfo(np.float64).eps  # neighbours within ulps


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([np.float32, np.float64]),
    st.sampled_from([1, 3, 50, 1 << 20]),
    st.lists(st.tuples(st.integers(0, 4), st.integers(1, 400)), min_size=1, max_size=4),
)
def test_order_statistics_equal_numpy_percentile(seed, dtype, gather, parts):
    rng = np.random.default_rng(seed)
    arrays = [_values(kind, n, rng).astype(dtype) for kind, n in parts]
    with mock.patch.object(quantiles, "GATHER", gather), mock.patch.object(quantiles, "CHUNK", 64):
        stats = order_statistics(
            [torch.from_numpy(a) for a in arrays],
            PERCENTILES,
            positive={"p10": 0.1, "p90": 0.9},
            dtype=torch.float32 if dtype == np.float32 else torch.float64,
        )
    everything = np.concatenate(arrays).astype(np.float64)
    assert stats.percentiles == {k: float(np.percentile(everything, q)) for k, q in PCT.items()}
    positive = everything[everything > 0]
    assert stats.positive_percentiles == (
        {k: float(np.percentile(positive, q)) for k, q in (("p10", 10), ("p90", 90))}
        if positive.size
        else {}
    )
    assert stats.count == everything.size
    assert stats.zeros == int((everything == 0).sum())
    assert stats.negatives == int((everything < 0).sum())
    assert stats.min_positive == (float(positive.min()) if positive.size else None)
    assert stats.passes <= (2 if dtype == np.float32 else 4)


def test_memory_stays_within_the_gathered_buckets(monkeypatch):
    """No pass keeps more than GATHER keys per needed rank, however many values stream by."""
    monkeypatch.setattr(quantiles, "GATHER", 100)
    rng = np.random.default_rng(0)
    values = [torch.from_numpy(rng.random(5000)) for _ in range(20)]
    stats = OrderStatistics(PERCENTILES)
    held = []
    while stats.wants_pass:
        for v in values:
            stats.add(v)
            held.append(sum(k.numel() for b in stats._buckets for k in b.keys))
            held.append(sum(k.numel() for k in stats._gathered or []))
        stats.end_pass()
    ranks = 2 * len(PERCENTILES)
    assert max(held) <= 100 * ranks + 100
    assert stats.passes >= 2  # the values did not fit: it selected
    everything = torch.cat(values).numpy()
    assert stats.percentiles == {k: float(np.percentile(everything, q)) for k, q in PCT.items()}


def test_sort_keys_order_like_the_floats():
    x = torch.tensor([3.0, -0.0, 0.0, -1e-310, 1e-310, -2.5, 7e300, -7e300], dtype=torch.float64)
    keys = sort_keys(x)
    assert torch.equal(keys.argsort(stable=True)[[0, 1, 2]], torch.tensor([7, 5, 3]))
    order = x[keys.argsort(stable=True)]
    assert torch.equal(order, x.sort(stable=True).values)
    assert int(keys[1]) == int(keys[2]) == 0  # −0.0 and +0.0 are one key


def test_non_finite_values_and_a_changed_stream_are_refused():
    stats = OrderStatistics({"p50": 0.5})
    with pytest.raises(gm.NonFiniteError, match="NaN or infinite"):
        stats.add(torch.tensor([1.0, float("nan")]))
    big = torch.rand(3 * (1 << 20), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    stats = OrderStatistics({"p50": 0.5})
    stats.add(big)
    stats.end_pass()
    assert stats.wants_pass
    stats.add(big[:-1000])  # a file rewritten between passes
    with pytest.raises(gm.ArgumentError, match="changed between passes"):
        stats.end_pass()


def _files(tmp_path):
    g = torch.Generator().manual_seed(5)
    shapes = {"emb.weight": (300, 8), "fc.weight": (6, 8), "fc.bias": (6,), "norm.weight": (8,)}

    def values(shape, dtype):
        v = torch.rand(shape, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
            -6, 3, shape, generator=g
        )
        return (v * (torch.rand(shape, generator=g) > 0.1)).to(dtype)  # some exact zeros

    a = gm.Diagonal({k: values(s, torch.float32) for k, s in shapes.items()})
    b = gm.Diagonal({k: values(s, torch.float64) for k, s in shapes.items()})

    def psd(n):
        x = torch.randn(n + 1, n, generator=g, dtype=torch.float64)
        return x.T @ x

    kfac = gm.KFAC({"fc": [(psd(9), psd(6)), (psd(9), psd(6))]}, bias=["fc"])
    c = gm.Blocks(
        [
            kfac,
            gm.Diagonal(
                {k: values(shapes[k], torch.float64) for k in ("emb.weight", "norm.weight")}
            ),
        ]
    )
    return {
        "a": a.save(tmp_path / "a.safetensors"),
        "b": b.save(tmp_path / "b.safetensors"),
        "c": c.save(tmp_path / "c.safetensors"),
    }, {"a": a, "b": b, "c": c}


@pytest.mark.parametrize("gather", [1 << 20, 5])
@pytest.mark.parametrize("which", ["abc", "a", "c"])  # one file: its own statistics give the sum
def test_inspect_percentiles_are_numpy_percentiles_of_the_files(
    tmp_path, capsys, monkeypatch, gather, which
):
    """Every file's and every layer's percentiles, and the δ window of their sum, equal
    numpy.percentile on the entries read back whole (K-FAC: its dense diagonal, the entries
    Σ_k G_k[o,o]·A_k[i,i]), whether they take one pass or several."""
    monkeypatch.setattr(quantiles, "GATHER", gather)
    paths, curvatures = _files(tmp_path)
    paths = {k: v for k, v in paths.items() if k in which}
    curvatures = {k: v for k, v in curvatures.items() if k in which}
    assert main(["inspect", *map(str, paths.values()), "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    entries = {}
    for name, c in curvatures.items():
        layout = [k for k, _ in c.layout]
        diag = c.to(dtype=torch.float64).dense().diagonal().numpy()
        offsets = np.cumsum([0] + [s.numel() for _, s in c.layout])
        entries[name] = {k: diag[offsets[i] : offsets[i + 1]] for i, k in enumerate(layout)}
    for f, name in zip(report["files"], curvatures, strict=True):
        whole = np.concatenate(list(entries[name].values()))
        assert {k: f["scale"][k] for k in PCT} == {
            k: float(np.percentile(whole, q)) for k, q in PCT.items()
        }
        assert f["scale"]["zeros"] == float((whole == 0).mean())
        for layer in f["layers"]:
            mine = np.concatenate([entries[name][k] for k in layer["keys"]])
            assert {k: layer["scale"][k] for k in PCT} == {
                k: float(np.percentile(mine, q)) for k, q in PCT.items()
            }
    keys = [k for k, _ in curvatures[which[0]].layout]
    total = np.concatenate([sum(entries[n][k] for n in curvatures) for k in keys])
    positive = total[total > 0]
    w = report["delta_window"]
    assert w["not_fisher_from"] == 1e-3 / (1 - 1e-3) * float(np.percentile(positive, 90))
    assert w["not_arithmetic_up_to"] == (1 - 1e-3) / 1e-3 * float(np.percentile(positive, 10))
