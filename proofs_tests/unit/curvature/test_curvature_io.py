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


def test_file_layout_is_the_documented_format(tmp_path):
    """Tensor names and spec of format gradmerge-curvature/1 (docs/architecture.md), written out
    literally: files saved before the codec was shared with the distributed reduction load, and
    new files are the same."""
    from safetensors import safe_open

    eye = lambda n: torch.eye(n, dtype=torch.float64)  # noqa: E731
    k = gm.KFAC(
        {"c": (eye(3), eye(2)), "conv": (eye(4), eye(2))},
        bias=["c"],
        transposed=["c"],
        weight_shapes={"conv": (2, 1, 2, 2)},
        counts={"c": 5},
    )
    d = gm.Diagonal({"n": torch.ones(2, dtype=torch.float64)})
    dense = gm.Dense(eye(2), {"e": torch.zeros(2, dtype=torch.float64)})
    s = gm.Sum([gm.Diagonal({"m": torch.ones(1, dtype=torch.float64)}), gm.ScaledIdentity(0.5)])
    c = gm.Blocks([k, d, dense, s])
    path = c.save(tmp_path / "c.safetensors")
    with safe_open(str(path), "pt") as f:
        names, meta = sorted(f.keys()), f.metadata()
    assert names == [
        "blocks0/kfac/c/0/A",
        "blocks0/kfac/c/0/G",
        "blocks0/kfac/conv/0/A",
        "blocks0/kfac/conv/0/G",
        "blocks1/diag/n",
        "blocks2/dense",
        "blocks3/sum0/diag/m",
    ]
    assert meta["format"] == "gradmerge-curvature/1" and meta["structure"] == "blocks"
    assert json.loads(meta["spec"]) == {
        "type": "blocks",
        "parts": [
            {
                "type": "kfac",
                "terms": {"c": 1, "conv": 1},
                "bias": ["c"],
                "transposed": ["c"],
                "weight_shapes": {"conv": [2, 1, 2, 2]},
                "counts": {"c": 5},
            },
            {"type": "diag", "keys": ["n"]},
            {"type": "dense", "layout": [["e", [2]]]},
            {
                "type": "sum",
                "parts": [{"type": "diag", "keys": ["m"]}, {"type": "identity", "delta": 0.5}],
            },
        ],
    }
    # a file from before K-FAC counts were saved (no "counts" in its spec) still loads
    old = json.loads(meta["spec"])
    del old["parts"][0]["counts"]
    from safetensors.torch import load_file, save_file

    save_file(
        load_file(str(path)), str(tmp_path / "old.safetensors"), {**meta, "spec": json.dumps(old)}
    )
    back = gm.load_curvature(tmp_path / "old.safetensors")
    assert back.blocks[0].counts == {}
    torch.testing.assert_close(back.dense(), c.dense(), rtol=0, atol=0)
