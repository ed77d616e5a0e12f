"""One validation of curvature files, shared by ``merge`` and ``inspect`` (issue 29, item 3).

What ``gradmerge merge`` refuses, ``gradmerge inspect`` reports as refused, with the same
message, and gives no δ window for (it exits 1, as ``merge --dry-run`` does where the real run
would refuse): negative diagonal entries, a K-FAC factor with eigenvalues −1…1, NaN values. A
``num_examples`` that is zero, negative or not a whole number is refused by both where the file
is opened, with one error line. A file that records no ``num_examples`` is accepted by both. ``--rho`` outside (0, 0.5) is an argument error.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

import gradmerge as gm
from gradmerge import cli


def _diagonal(values, **meta):
    c = gm.Diagonal({"fc.weight": values.reshape(2, 3).double(), "fc.bias": torch.ones(2).double()})
    c.meta.update(meta)
    return c


def _kfac(a_eigenvalues):
    """A K-FAC layer whose input factor A has the given eigenvalues (in a rotated basis)."""
    q, _ = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)).double())
    a = q @ torch.diag(torch.tensor(a_eigenvalues).double()) @ q.T
    return gm.KFAC({"fc": (a, torch.eye(2).double())}, bias=["fc"])


CASES = [
    # (name, curvature, message merge and inspect give)
    ("negative diagonal", lambda: _diagonal(-torch.linspace(1, 2, 6)), "not positive semi-definite"),
    ("K-FAC factor with eigenvalues -1..1", lambda: _kfac([-1.0, -0.3, 0.4, 1.0]),
     "not positive semi-definite"),
    ("NaN entry", lambda: _diagonal(torch.ones(6)), "NaN/Inf value"),
    ("num_examples 0", lambda: _diagonal(torch.ones(6), num_examples="0"), "num_examples is '0'"),
    ("num_examples -5", lambda: _diagonal(torch.ones(6), num_examples="-5"), "num_examples is '-5'"),
    ("num_examples abc", lambda: _diagonal(torch.ones(6), num_examples="abc"),
     "num_examples is 'abc'"),
    ("num_examples 1.5", lambda: _diagonal(torch.ones(6), num_examples="1.5"),
     "num_examples is '1.5'"),
]  # fmt: skip


@pytest.fixture
def models(tmp_path):
    save_file({"fc.weight": torch.zeros(2, 3).double(), "fc.bias": torch.zeros(2).double()},
              tmp_path / "base.safetensors")  # fmt: skip
    save_file({"fc.weight": torch.ones(2, 3).double(), "fc.bias": torch.ones(2).double()},
              tmp_path / "ft.safetensors")  # fmt: skip
    return tmp_path


def _merge_yaml(folder, curvature):
    config = {
        "method": "gradient_matching",
        "base_model": "base.safetensors",
        "models": [{"model": "ft.safetensors", "curvature": curvature.name}],
        "prior": {"delta": 1.0e-3},
    }
    path = folder / "merge.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(("name", "build", "message"), CASES, ids=[c[0] for c in CASES])
def test_what_merge_refuses_inspect_reports_refused(models, capsys, name, build, message):
    path = build().save(models / "c.safetensors")
    if name == "NaN entry":  # gm.Diagonal refuses NaN: write it into the file, as damage would
        with safe_open(path, "pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
        tensors["diag/fc.weight"][0, 1] = float("nan")
        save_file(tensors, path, metadata=meta)
    assert cli.main(["merge", str(_merge_yaml(models, path)), str(models / "out"),
                     "--no-progress"]) == 1  # fmt: skip
    refused = capsys.readouterr().err
    assert message in refused and not (models / "out").exists()
    assert cli.main(["inspect", str(path), "--json", str(models / "r.json")]) == 1
    if name.startswith("num_examples"):  # no file to summarise: the merge's error, one line
        err = capsys.readouterr().err
        assert err.startswith("gradmerge inspect: error:") and err.count("\n") == 1
        assert message in err and not (models / "r.json").exists()
        return
    out = capsys.readouterr().out
    assert "REFUSED (a merge refuses it too)" in out and message in out
    assert "δ window for the file: none (a merge refuses 1 of the files" in out
    report = json.loads((models / "r.json").read_text())
    (entry,) = report["files"]
    assert message in entry["refused"]
    assert report["delta_window"]["low"] is None and report["delta_window"]["empty"]


def test_a_curvature_that_records_no_num_examples_is_accepted_by_both(models, capsys):
    path = _diagonal(torch.linspace(1, 2, 6)).save(models / "c.safetensors")
    assert cli.main(["merge", str(_merge_yaml(models, path)), str(models / "out"),
                     "--no-progress"]) == 0  # fmt: skip
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "num_examples not recorded" in out and "REFUSED" not in out
    assert "δ window for the file: [" in out


@pytest.mark.parametrize("rho", ["0", "-1", "1", "0.5", "nan", "inf"])
def test_rho_outside_its_range_is_an_argument_error(models, capsys, rho):
    path = _diagonal(torch.linspace(1, 2, 6)).save(models / "c.safetensors")
    with pytest.raises(SystemExit) as info:
        cli.main(["inspect", str(path), "--rho", rho])
    assert info.value.code == 2
    assert "rho (--rho) must be in (0, 0.5)" in capsys.readouterr().err
    with pytest.raises(gm.ArgumentError, match=r"must be in \(0, 0.5\)"):
        from gradmerge.commands.inspect import inspect_files

        inspect_files([path], rho=float(rho))
