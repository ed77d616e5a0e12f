"""Saving and loading curvatures: fingerprints, atomic writes, bad files, tensors that share memory
(every structure's exact round trip is in test_conformance.py)."""

import json

import numpy as np
import pytest
import torch

import gradmerge as gm
from gradmerge import params as P
from proofs_tests.reference import spd_tensor

DT = torch.float64


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


def test_saving_curvatures_that_share_tensors(tmp_path):
    rng = np.random.default_rng(4)
    k = gm.KFAC(
        {"fc": (spd_tensor(rng, 3, dtype=torch.float64), spd_tensor(rng, 2, dtype=torch.float64))}
    )
    for c in (k + k, k + 0.5 * k):
        back = gm.load_curvature(c.save(tmp_path / "c.safetensors"))
        torch.testing.assert_close(back.dense(), c.dense(), rtol=0, atol=0)
