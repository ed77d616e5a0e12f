"""Issue 13, cases 1, 2, 11 and 13: `gradmerge curvature` on inputs that do not fit.

1: a Hugging Face folder whose weights lack tensors the config needs loaded with those tensors
randomly initialised (two runs, two curvatures); 2: an OUT inside MODEL replaced the model's own
weights; 11: token ids ≥ the vocabulary or sequences longer than the positions gave a bare
IndexError; 13: an OUT that cannot be written failed only after the whole estimate, and
`gradmerge merge --dry-run` said "inputs fit together" without saying that values are not read.
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import gradmerge as gm
from gradmerge import cli
from proofs_tests.workspace import make_workspace


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("gpt2")
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(root / "model")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (4, 8), generator=g)
    save_file({"input_ids": ids, "labels": ids.clone()}, root / "data.safetensors")
    return root


def _copy(gpt2_folder, tmp_path, change=None):
    folder = tmp_path / "model"
    shutil.copytree(gpt2_folder / "model", folder)
    if change is not None:
        weights = load_file(folder / "model.safetensors")
        change(weights)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _curvature(folder, data, out, *extra):
    return cli.main(
        ["curvature", str(folder), str(data), str(out), "--shift-labels", "--no-progress", *extra]
    )


# ----- case 1 ------------------------------------------------------------------------------------
def test_case1_missing_weights_are_an_error_naming_them(gpt2_folder, tmp_path, capsys):
    def drop_layer_1(weights):
        for key in [k for k in weights if k.startswith("transformer.h.1.")]:
            del weights[key]

    folder = _copy(gpt2_folder, tmp_path, drop_layer_1)
    out = tmp_path / "c.safetensors"
    assert _curvature(folder, gpt2_folder / "data.safetensors", out) == 1
    err = capsys.readouterr().err
    assert "missing from the weights" in err and "'transformer.h.1." in err
    assert "--allow-new-weights" in err and not out.exists()


def test_case1_unexpected_weights_are_an_error_naming_them(gpt2_folder, tmp_path, capsys):
    folder = _copy(gpt2_folder, tmp_path, lambda w: w.update({"extra.weight": torch.ones(3)}))
    assert _curvature(folder, gpt2_folder / "data.safetensors", tmp_path / "c.safetensors") == 1
    assert "stored but not used by the model: ['extra.weight']" in capsys.readouterr().err


def test_case1_new_weights_are_accepted_only_on_request(gpt2_folder, tmp_path, capsys):
    folder = _copy(gpt2_folder, tmp_path, lambda w: w.pop("transformer.ln_f.weight"))
    out = tmp_path / "c.safetensors"
    argv = ("--allow-new-weights",)
    assert _curvature(folder, gpt2_folder / "data.safetensors", out, *argv) == 0
    assert "transformer.ln_f.weight" in capsys.readouterr().err and out.is_file()


def test_case1_a_complete_folder_loads_silently(gpt2_folder, tmp_path, capsys):
    out = tmp_path / "c.safetensors"
    assert _curvature(gpt2_folder / "model", gpt2_folder / "data.safetensors", out) == 0
    assert "missing" not in capsys.readouterr().err


# ----- case 2 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["model.safetensors", "c.curvature.safetensors"])
def test_case2_out_inside_model_is_refused(gpt2_folder, tmp_path, capsys, name):
    folder = _copy(gpt2_folder, tmp_path)
    before = (folder / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit) as info:
        _curvature(folder, gpt2_folder / "data.safetensors", folder / name, "--overwrite")
    assert info.value.code == 2
    assert "lies inside MODEL" in capsys.readouterr().err
    assert (folder / "model.safetensors").read_bytes() == before
    assert not (folder / "c.curvature.safetensors").exists()


def test_case2_out_equal_to_data_is_refused(gpt2_folder, tmp_path, capsys):
    data = tmp_path / "data.safetensors"
    shutil.copy(gpt2_folder / "data.safetensors", data)
    with pytest.raises(SystemExit):
        _curvature(gpt2_folder / "model", data, data, "--overwrite")
    assert "is DATA" in capsys.readouterr().err
    assert set(load_file(data)) == {"input_ids", "labels"}


# ----- case 11 -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (torch.full((2, 8), 32), "token id 32 is outside the model's vocabulary of 32"),
        (torch.full((2, 8), -3), "token id -3 is outside the model's vocabulary"),
        (torch.zeros(2, 9, dtype=torch.long), "sequences of 9 tokens, but the model has 8"),
    ],
)
def test_case11_token_ids_and_lengths_are_checked_first(
    gpt2_folder, tmp_path, capsys, ids, message
):
    save_file({"input_ids": ids, "labels": ids.clone()}, tmp_path / "bad.safetensors")
    out = tmp_path / "c.safetensors"
    assert _curvature(gpt2_folder / "model", tmp_path / "bad.safetensors", out) == 1
    err = capsys.readouterr().err
    assert message in err and "IndexError" not in err and not out.exists()


def test_case11_in_python_too(gpt2_folder, tmp_path):
    from gradmerge.io.sources import load_data, load_model

    model = load_model(str(gpt2_folder / "model"))
    save_file(
        {"input_ids": torch.full((1, 8), 40), "labels": torch.zeros(1, 8, dtype=torch.long)},
        tmp_path / "oov.safetensors",
    )
    with pytest.raises(gm.StructureError, match="example 0: token id 40"):
        load_data(str(tmp_path / "oov.safetensors"), model=model)


# ----- case 13 -----------------------------------------------------------------------------------
def test_case13_unwritable_out_is_refused_before_estimating(
    gpt2_folder, tmp_path, capsys, monkeypatch
):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    estimated = []
    monkeypatch.setattr(gm, "estimate_curvature", lambda *a, **k: estimated.append(1))
    with pytest.raises(SystemExit) as info:
        _curvature(
            gpt2_folder / "model",
            gpt2_folder / "data.safetensors",
            blocker / "sub" / "c.safetensors",
        )
    assert info.value.code == 2 and estimated == []
    assert f"cannot be written: {blocker} is a file, not a folder" in capsys.readouterr().err


def test_case13_read_only_folder_is_refused_before_estimating(gpt2_folder, tmp_path, capsys):
    import os

    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as a user who can write to a read-only folder (root)")
        with pytest.raises(SystemExit):
            _curvature(
                gpt2_folder / "model", gpt2_folder / "data.safetensors", folder / "c.safetensors"
            )
        assert "cannot be written" in capsys.readouterr().err
    finally:
        folder.chmod(0o755)


def test_case13_dry_run_says_values_are_not_checked(tmp_path, capsys):
    ws = make_workspace(tmp_path / "ws", "diag")
    nan = ws.load(ws.models[0])
    nan["0.weight"][0, 0] = float("nan")
    save_file(nan, ws.root / "nan.safetensors")
    config = {
        "method": "task_arithmetic",
        "base_model": "base.safetensors",
        "models": [{"model": "nan.safetensors"}],
    }
    path = str(ws.yaml("nan.yaml", config))
    assert cli.main(["merge", path, str(tmp_path / "out"), "--dry-run"]) == 0
    assert "values — NaN/Inf — are checked only by the real run" in capsys.readouterr().out
    assert cli.main(["merge", path, str(tmp_path / "out"), "--no-progress"]) == 1
    assert "NaN" in capsys.readouterr().err
