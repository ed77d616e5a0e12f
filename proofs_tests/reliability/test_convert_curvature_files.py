"""Issue 21, items 3 and 4: ``gradmerge convert-curvature`` never writes over or into its SRC,
and never reads a gradmerge curvature file as an official Fisher.

Before: ``convert-curvature F.safetensors F.safetensors --overwrite`` replaced the official Fisher
with its own output (exit 0), and ``convert-curvature hb hb/F.safetensors`` wrote inside SRC,
after which converting ``hb`` again read ``F.safetensors`` (safetensors win over ``.bin``).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import gradmerge as gm
from gradmerge import cli
from gradmerge.errors import FileFormatError, OutputOverlapError
from gradmerge.io.official import convert_curvature

FISHER = {"w": torch.tensor([1.0, 0.5, 2.0]), "b": torch.tensor([0.25])}


def _convert(capsys, *argv):
    """Exit status of the command (2 for a usage error) and its stderr."""
    try:
        code = cli.main(["convert-curvature", *map(str, argv)])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def test_out_equal_to_src_is_refused_and_the_fisher_kept(tmp_path, capsys):
    src = tmp_path / "fisher.safetensors"
    save_file(FISHER, src)
    before = src.read_bytes()
    code, err = _convert(capsys, src, src, "--overwrite")
    assert code == 2 and "OUT " + str(src) + " is SRC" in err
    assert src.read_bytes() == before
    with pytest.raises(OutputOverlapError, match="is SRC"):
        convert_curvature(src, src)
    assert src.read_bytes() == before


@pytest.mark.parametrize("layout", ["hessian folder", "run folder"])
def test_out_inside_src_is_refused(tmp_path, capsys, layout):
    run = tmp_path / "run"
    (run / "hessian").mkdir(parents=True)
    torch.save(FISHER, run / "hessian" / "pytorch_model.bin")
    src = run / "hessian" if layout == "hessian folder" else run
    out = run / "hessian" / "F.safetensors"
    code, err = _convert(capsys, src, out)
    assert code == 2 and "lies inside SRC" in err
    assert not out.exists()
    with pytest.raises(OutputOverlapError, match="lies inside SRC"):
        convert_curvature(src, out)
    assert sorted(p.name for p in (run / "hessian").iterdir()) == ["pytorch_model.bin"]


def test_a_gradmerge_curvature_is_refused_as_src(tmp_path, capsys):
    converted = tmp_path / "F.safetensors"
    assert _convert(capsys, tmp_path / "missing", converted)[0] == 1
    torch.save(FISHER, tmp_path / "fisher.bin")
    assert _convert(capsys, tmp_path / "fisher.bin", converted)[0] == 0
    code, err = _convert(capsys, converted, tmp_path / "again.safetensors")
    assert code == 1 and "is a gradmerge curvature file" in err and "converted already" in err
    assert not (tmp_path / "again.safetensors").exists()
    # a folder that holds one (an output written there before this check existed) is refused
    hb = tmp_path / "hb"
    hb.mkdir()
    torch.save({k: 3 * v for k, v in FISHER.items()}, hb / "pytorch_model.bin")
    (hb / "F.safetensors").write_bytes(converted.read_bytes())
    with pytest.raises(FileFormatError, match=r"holds F\.safetensors, which is a gradmerge"):
        convert_curvature(hb, tmp_path / "hb.safetensors")
    (hb / "F.safetensors").unlink()
    converted_hb = convert_curvature(hb, tmp_path / "hb.safetensors")
    torch.testing.assert_close(converted_hb.values["w"], 3 * FISHER["w"], rtol=0, atol=0)
    assert gm.load_curvature(tmp_path / "hb.safetensors").values.keys() == FISHER.keys()
