"""open_curvature: coupling groups, partial reads, and restrictions equal to the whole operator."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import gradmerge as gm
from gradmerge.curvature.io import FORMAT, open_curvature
from proofs_tests.reference import random_spd

DT = torch.float64


def _spd(rng, n):
    return torch.as_tensor(random_spd(rng, n), dtype=DT)


def _curvatures():
    rng = np.random.default_rng(0)
    kfac = gm.KFAC(
        {
            "fc": (_spd(rng, 4), _spd(rng, 2)),
            "h.attn": (_spd(rng, 3), _spd(rng, 4)),
            "conv": (_spd(rng, 4), _spd(rng, 2)),
        },
        bias=["fc", "h.attn"],
        transposed=["h.attn"],
        weight_shapes={"conv": (2, 1, 2, 2)},
    )
    diag = gm.Diagonal(
        {"norm.weight": torch.rand(4, dtype=DT) + 0.1, "norm.bias": torch.rand(4, dtype=DT) + 0.1}
    )
    dense = gm.Dense(_spd(rng, 6), {"emb.a": torch.zeros(2, 2), "emb.b": torch.zeros(2)})
    two = gm.KFAC({"fc": [(_spd(rng, 4), _spd(rng, 2)), (_spd(rng, 4), _spd(rng, 2))]}, bias=["fc"])
    fc_diag = gm.Diagonal(
        {"fc.weight": torch.rand(2, 3, dtype=DT) + 0.1, "fc.bias": torch.rand(2, dtype=DT) + 0.1}
    )
    return {
        "diag": (diag, [("norm.weight",), ("norm.bias",)]),
        "kfac": (
            kfac,
            [("fc.weight", "fc.bias"), ("h.attn.weight", "h.attn.bias"), ("conv.weight",)],
        ),
        "dense": (dense, [("emb.a", "emb.b")]),
        "blocks": (
            gm.Blocks([kfac, diag, dense]),
            [
                ("fc.weight", "fc.bias"),
                ("h.attn.weight", "h.attn.bias"),
                ("conv.weight",),
                ("norm.weight",),
                ("norm.bias",),
                ("emb.a", "emb.b"),
            ],
        ),
        "two-term-kfac": (two, [("fc.weight", "fc.bias")]),
        "sum": (two + fc_diag, [("fc.weight", "fc.bias")]),  # K-FAC + diagonal: a lazy Sum
    }


@pytest.mark.parametrize("name", list(_curvatures()))
def test_every_group_restricts_exactly(tmp_path, name):
    curvature, groups = _curvatures()[name]
    curvature.meta["num_examples"] = "12"
    path = curvature.save(tmp_path / "c.safetensors")
    with open_curvature(path) as f:
        assert f.couplings() == groups and f.bytes_read == 0
        assert f.structure == {"two-term-kfac": "kfac"}.get(name, name)
        v = {k: torch.randn(s, dtype=DT) for k, s in curvature.layout}
        whole = curvature.mv(v)
        solved = (curvature + 0.5).solve(v)
        for group in groups:
            part = f.restrict(group)
            assert {k for k, _ in part.layout} == set(group)
            assert part.meta["num_examples"] == "12"
            sub = {k: v[k] for k in group}
            got = part.mv(sub)
            for k in group:
                torch.testing.assert_close(got[k], whole[k], rtol=1e-12, atol=1e-12)
            x = (part + 0.5).solve(sub)
            for k in group:
                torch.testing.assert_close(x[k], solved[k], rtol=1e-10, atol=1e-12)
        assert f.restrict(["unrelated"]) is None


def test_only_the_group_is_read(tmp_path):
    curvature, _ = _curvatures()["blocks"]
    path = curvature.save(tmp_path / "c.safetensors")
    with open_curvature(path) as f:
        f.restrict(["fc.weight", "fc.bias"])
        assert f.bytes_read == (4 * 4 + 2 * 2) * 8  # that layer's A and G, nothing else
        f.restrict(["norm.bias"])
        assert f.bytes_read == (4 * 4 + 2 * 2 + 4) * 8
        whole = f.load()
        assert whole.dense().shape == curvature.dense().shape
        torch.testing.assert_close(whole.dense(), curvature.dense(), rtol=0, atol=0)
        part = f.restrict(["conv.weight"], dtype=torch.float32)
        assert (
            part.mv({"conv.weight": torch.ones(2, 1, 2, 2)})["conv.weight"].dtype == torch.float32
        )


def test_a_group_cannot_be_split(tmp_path):
    curvature, _ = _curvatures()["blocks"]
    with open_curvature(curvature.save(tmp_path / "c.safetensors")) as f:
        with pytest.raises(
            gm.ArgumentError, match=r"couples \['fc.weight', 'fc.bias'\].*whole coupling groups"
        ):
            f.restrict(["fc.weight"])
        with pytest.raises(gm.ArgumentError, match="couples"):
            f.restrict(["emb.a"])


def test_damaged_files(tmp_path):
    good = gm.Diagonal({"w": torch.ones(100)}).save(tmp_path / "good.safetensors")
    (tmp_path / "trunc.safetensors").write_bytes(good.read_bytes()[:-16])
    with pytest.raises(gm.FileFormatError, match="truncated or corrupt"):
        open_curvature(tmp_path / "trunc.safetensors")
    with pytest.raises(FileNotFoundError):
        open_curvature(tmp_path / "absent.safetensors")
    meta = {
        "format": FORMAT,
        "structure": "diag",
        "spec": json.dumps({"type": "diag", "keys": ["w", "v"]}),
    }
    layout = [["w", [2]], ["v", [2]]]
    from gradmerge.curvature.io import fingerprint

    meta["layout"] = json.dumps(layout)
    meta["fingerprint"] = fingerprint(tuple((k, torch.Size(s)) for k, s in layout))
    save_file({"diag/w": torch.ones(2)}, tmp_path / "missing.safetensors", metadata=meta)
    with pytest.raises(gm.FileFormatError, match=r"lacks 1 tensor.*diag/v"):
        open_curvature(tmp_path / "missing.safetensors")
    save_file({"x": torch.ones(1)}, tmp_path / "plain.safetensors", metadata={"format": "pt"})
    with pytest.raises(gm.FileFormatError, match="not a gradmerge curvature file"):
        open_curvature(tmp_path / "plain.safetensors")
    meta["fingerprint"] = "0" * 64
    save_file(
        {"diag/w": torch.ones(2), "diag/v": torch.ones(2)},
        tmp_path / "fp.safetensors",
        metadata=meta,
    )
    with pytest.raises(gm.FileFormatError, match="fingerprint"):
        open_curvature(tmp_path / "fp.safetensors")
