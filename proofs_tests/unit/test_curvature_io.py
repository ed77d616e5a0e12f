"""Saving and loading curvatures: exact round trips, fingerprints, atomic writes, bad files."""

import json

import numpy as np
import pytest
import torch

import gradmerge as gm
from gradmerge import params as P
from proofs_tests.reference import random_spd

DT = torch.float64


def _curvatures():
    rng = np.random.default_rng(0)
    spd = lambda n: torch.as_tensor(random_spd(rng, n), dtype=DT)  # noqa: E731
    kfac = gm.KFAC({"fc": [(spd(3), spd(2)), (spd(3), spd(2))]}, bias=["fc"])
    diag = gm.Diagonal({"norm.weight": torch.rand(4, dtype=DT) + 0.1})
    dense = gm.Dense(spd(4), {"emb": torch.zeros(2, 2)})
    return {
        "diag": diag,
        "dense": dense,
        "kfac": kfac,
        "blocks": gm.Blocks([kfac, diag, dense]),
        "kfac-transposed": gm.KFAC(
            {"h.c_attn": (spd(3), spd(2)), "conv": (spd(4), spd(2))},
            bias=["h.c_attn"],
            transposed=["h.c_attn"],
            weight_shapes={"conv": (2, 1, 2, 2)},
        ),
        "sum": kfac
        + gm.Diagonal(
            {"fc.weight": torch.ones(2, 2, dtype=DT), "fc.bias": torch.ones(2, dtype=DT)}
        ),
    }


@pytest.mark.parametrize("name", list(_curvatures()))
def test_round_trip_is_exact(tmp_path, name):
    c = _curvatures()[name]
    c.meta.update({"fisher": "empirical", "num_examples": "128"})
    path = c.save(tmp_path / f"{name}.safetensors")
    back = gm.load_curvature(path)
    assert type(back) is type(c)
    assert dict(back.layout) == dict(c.layout)
    torch.testing.assert_close(back.dense(c.layout), c.dense(c.layout), rtol=0, atol=0)
    assert back.meta == {"fisher": "empirical", "num_examples": "128"}


def test_fingerprint_mismatch_is_refused(tmp_path):
    c = gm.Diagonal({"0.weight": torch.ones(3, 2), "0.bias": torch.ones(3)})
    path = c.save(tmp_path / "c.safetensors")
    gm.load_curvature(path, like=torch.nn.Sequential(torch.nn.Linear(2, 3)))  # fits
    with pytest.raises(
        gm.StructureError, match=r"other parameters.*0.weight: file \(3, 2\), model \(4, 2\)"
    ):
        gm.load_curvature(path, like=torch.nn.Sequential(torch.nn.Linear(2, 4)))
    with pytest.raises(gm.StructureError, match="not in the model"):
        gm.load_curvature(path, like={"other": torch.zeros(1)})


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        gm.load_curvature(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(gm.FileFormatError, match="not a readable safetensors"):
        gm.load_curvature(junk)
    good = gm.Diagonal({"w": torch.ones(1000)}).save(tmp_path / "good.safetensors")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(gm.FileFormatError):
        gm.load_curvature(truncated)
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"w": torch.ones(2)}, str(other), metadata={"format": "something-else"})
    with pytest.raises(gm.FileFormatError, match="not a gradmerge curvature file"):
        gm.load_curvature(other)


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.torch

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        gm.Diagonal({"w": torch.ones(3)}).save(tmp_path / "c.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_metadata_is_readable_without_gradmerge(tmp_path):
    from safetensors import safe_open

    path = gm.Diagonal({"w": torch.ones(3, dtype=DT)}).save(tmp_path / "c.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["structure"] == "diag" and meta["dtype"] == "float64"
    assert json.loads(meta["layout"]) == [["w", [3]]]
    assert meta["fingerprint"] == gm.curvature.io.fingerprint(P.layout_of({"w": torch.ones(3)}))
