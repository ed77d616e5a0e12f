"""`gradmerge curvature MODEL DATA OUT`: files against brute-force references, and bad input.

References: per-example autograd gradients squared and summed (the definition of the diagonal
empirical Fisher), the closed form I ⊗ XᵀX of a linear least-squares Hessian, and Hugging Face's
own causal-LM loss (its label shifting and ignore_index) for `--shift-labels` and padding masks.
"""

from __future__ import annotations

import argparse
import textwrap

import pytest
import torch
from safetensors.torch import save_file

import gradmerge as gm
from gradmerge import cli
from gradmerge.commands import curvature
from gradmerge.io.sources import TensorBatches

ENTRY_POINTS = textwrap.dedent(
    """
    import torch
    from torch import nn

    X = torch.linspace(-1.0, 1.0, 15, dtype=torch.float64).reshape(5, 3)

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()

    def linear():
        torch.manual_seed(1)
        return nn.Linear(3, 2, bias=False).double()

    def regression():
        y = torch.arange(10, dtype=torch.float64).reshape(5, 2)
        return [(X[:3], y[:3]), (X[3:], y[3:])]

    def one_shot():
        return iter(regression())

    def nan_batches():
        return [(X * float("nan"), torch.zeros(5, dtype=torch.long))]

    def not_a_model():
        return 3

    def not_batches():
        return 42

    NOT_CALLABLE = 1
    """
)


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "gm_test_entry.py").write_text(ENTRY_POINTS)
    x = torch.linspace(-2.0, 2.0, 15, dtype=torch.float64).reshape(5, 3)
    torch.save({"inputs": x, "targets": torch.tensor([0, 1, 1, 0, 1])}, tmp_path / "cls.pt")
    return tmp_path


def _run(*argv: str) -> int:
    return cli.main(["curvature", *argv, "--no-progress"])


def _execute(*argv: str) -> int:
    """The command without its error reporting: typed errors propagate."""
    parser = argparse.ArgumentParser()
    curvature.add_parser(parser.add_subparsers())
    args = parser.parse_args(["curvature", *argv, "--no-progress"])
    args.check(parser, args)
    return curvature.execute(args)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
    ).double()


def _brute_force_diag(model, examples, loss_of_example):
    """Σ_i (∇ℓ_i)², one autograd call per example: the definition, independently of gradmerge."""
    params = dict(model.named_parameters())
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    for example in examples:
        grads = torch.autograd.grad(loss_of_example(model, example), list(params.values()))
        for k, g in zip(params, grads, strict=True):
            total[k] += g**2
    return total


def test_diag_empirical_of_an_entry_point_model_on_a_tensor_file(workdir, capsys):
    out = workdir / "mlp.curvature.safetensors"
    code = _run(
        f"{workdir}/gm_test_entry.py:mlp", str(workdir / "cls.pt"), str(out), "--batch-size", "2"
    )
    assert code == 0
    assert "a sum over 5 examples" in capsys.readouterr().out
    data = torch.load(workdir / "cls.pt", weights_only=True)
    model = _mlp()
    ref = _brute_force_diag(
        model,
        zip(data["inputs"], data["targets"], strict=True),
        lambda m, ex: torch.nn.functional.cross_entropy(m(ex[0][None]), ex[1][None]),
    )
    loaded = gm.load_curvature(out, like=model)
    assert isinstance(loaded, gm.Diagonal)
    for k, v in ref.items():
        torch.testing.assert_close(loaded.values[k], v, rtol=1e-12, atol=1e-14)
    assert loaded.meta["num_examples"] == "5" and loaded.meta["fisher"] == "empirical"
    assert loaded.meta["source.model"] == f"{workdir / 'gm_test_entry.py'}:mlp"
    assert loaded.meta["source.data"] == str(workdir / "cls.pt")
    assert loaded.meta["source.batch_size"] == "2" and len(loaded.meta["source.data_sha256"]) == 64


def test_full_hessian_of_least_squares_is_the_closed_form(workdir, monkeypatch):
    """½‖W x − y‖² summed over examples has Hessian I_out ⊗ XᵀX in vec(W) (row-major)."""
    monkeypatch.chdir(workdir)  # module:function imports from the current folder
    out = workdir / "h.safetensors"
    args = ["gm_test_entry:linear", "gm_test_entry:regression", str(out)]
    assert _run(*args, "--structure", "full", "--fisher", "hessian", "--loss", "mse") == 0
    x = torch.linspace(-1.0, 1.0, 15, dtype=torch.float64).reshape(5, 3)
    loaded = gm.load_curvature(out)
    assert isinstance(loaded, gm.Dense)
    torch.testing.assert_close(loaded.matrix, torch.kron(torch.eye(2, dtype=x.dtype), x.T @ x))
    assert loaded.meta["source.model"] == "gm_test_entry:linear"


def test_kfac_through_the_command_equals_the_library_call(workdir):
    out = workdir / "k.safetensors"
    args = [
        f"{workdir}/gm_test_entry.py:mlp",
        str(workdir / "cls.pt"),
        str(out),
        "--batch-size",
        "3",
    ]
    assert _run(*args, "--structure", "kfac", "--fisher", "mc", "--seed", "3") == 0
    data = torch.load(workdir / "cls.pt", weights_only=True)
    batches = [(data["inputs"][:3], data["targets"][:3]), (data["inputs"][3:], data["targets"][3:])]
    model = _mlp()
    ref = gm.estimate_curvature(model, batches, structure="kfac", fisher="mc", seed=3)
    loaded = gm.load_curvature(out, like=model)
    assert isinstance(loaded, gm.KFAC)
    torch.testing.assert_close(loaded.dense(), ref.dense(), rtol=1e-12, atol=1e-14)
    assert loaded.meta["kfac_approx"] == "expand" and loaded.meta["source.seed"] == "3"


# ----- Hugging Face folders -------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("gpt2")
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=20, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).double().save_pretrained(folder / "model")
    ids = torch.randint(1, 20, (4, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # right padding
    mask[3, 2:] = 0
    hf_labels = torch.where(mask == 1, ids, torch.full_like(ids, -100))
    save_file(
        {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask},
        str(folder / "tokens.safetensors"),
    )
    model = transformers.GPT2LMHeadModel.from_pretrained(folder / "model", local_files_only=True)
    return folder, model.eval(), ids, mask, hf_labels


def test_hugging_face_folder_with_shifted_labels_matches_hugging_faces_loss(gpt2, capsys):
    """--shift-labels + attention_mask: example i's loss is Hugging Face's causal-LM loss, the
    sum over s of CE(logits[s], labels[s + 1]) with padded labels (-100) left out.

    The float64 reference writes that shift out by hand (HF's own loss casts logits to float32);
    that it IS HF's loss is checked to float32 precision on the side."""
    folder, model, ids, mask, hf_labels = gpt2
    out = folder / "diag.safetensors"
    tokens = str(folder / "tokens.safetensors")
    args = [str(folder / "model"), tokens, str(out), "--batch-size", "3", "--shift-labels"]
    assert _run(*args) == 0
    assert "warning" not in capsys.readouterr().err

    def shifted_loss(m, i):
        logits = m(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1]).logits[0]
        return torch.nn.functional.cross_entropy(logits[:-1], hf_labels[i, 1:], reduction="sum")

    for i in range(len(ids)):  # the shift above is Hugging Face's (a mean over counted tokens)
        hf = model(
            input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1], labels=hf_labels[i : i + 1]
        )
        counted = int((hf_labels[i, 1:] != -100).sum())
        torch.testing.assert_close(
            hf.loss.double() * counted, shifted_loss(model, i), rtol=1e-6, atol=0
        )
    ref = _brute_force_diag(model, range(len(ids)), shifted_loss)
    loaded = gm.load_curvature(out, like=model)
    assert set(loaded.values) == set(ref)
    for k, v in ref.items():
        torch.testing.assert_close(loaded.values[k], v, rtol=1e-10, atol=1e-14)
    assert loaded.meta["source.shift_labels"] == "True"
    assert loaded.meta["source.model"] == str(folder / "model")


def test_unshifted_causal_lm_labels_are_warned_about(gpt2, capsys):
    folder = gpt2[0]
    out = folder / "unshifted.safetensors"
    assert _run(str(folder / "model"), str(folder / "tokens.safetensors"), str(out)) == 0
    assert "pass --shift-labels" in capsys.readouterr().err


def test_tensor_batches_shift_and_mask():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    batches = TensorBatches(
        {"input_ids": ids, "labels": ids, "attention_mask": mask}, batch_size=1, shift_labels=True
    )
    assert len(batches) == 2
    first, second = list(batches)
    assert first["labels"].tolist() == [[6, 7, -100, -100]]
    assert second["labels"].tolist() == [[9, -100, -100, -100]]
    assert torch.equal(second["input_ids"], ids[1:]) and "attention_mask" in second


# ----- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--structure", "diag", "--fisher", "hessian"],
            "--fisher hessian is available for --structure full",
        ),
        (["--mc-samples", "0"], "--mc-samples must be a positive integer"),
        (
            ["--kfac-max-factor-side", "none", "--max-params", "0"],
            "--max-params must be a positive integer",
        ),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
    ],
)
def test_bad_options_are_argparse_errors(workdir, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        _run(
            f"{workdir}/gm_test_entry.py:mlp",
            str(workdir / "cls.pt"),
            str(workdir / "o.st"),
            *extra,
        )
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (workdir / "o.st").exists()


@pytest.mark.parametrize(
    ("model", "data", "extra", "message"),
    [
        ("missing_folder", "cls.pt", [], "MODEL 'missing_folder' is neither a folder nor"),
        ("gm_test_entry.py:mlp", "missing.pt", [], "DATA file missing.pt does not exist"),
        ("gm_test_entry.py:mlp", "data.xlsx", [], "is neither a data file nor an entry point"),
        ("gm_test_entry.py:mlp", "data.csv", [], "DATA file data.csv does not exist"),
        ("gm_test_entry.py:1mlp", "cls.pt", [], "is not an entry point"),
        (
            "gm_test_entry.py:mlp",
            "gm_test_entry.py:regression",
            ["--batch-size", "4"],
            "--batch-size applies",
        ),
        (
            "gm_test_entry.py:mlp",
            "gm_test_entry.py:regression",
            ["--shift-labels"],
            "--shift-labels applies",
        ),
    ],
)
def test_bad_paths_are_argparse_errors(workdir, monkeypatch, capsys, model, data, extra, message):
    monkeypatch.chdir(workdir)
    with pytest.raises(SystemExit) as exit_info:
        _run(model, data, "o.safetensors", *extra)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_existing_out_needs_overwrite(workdir, capsys):
    out = workdir / "c.safetensors"
    out.write_text("old")
    args = [f"{workdir}/gm_test_entry.py:mlp", str(workdir / "cls.pt"), str(out)]
    with pytest.raises(SystemExit):
        _run(*args)
    assert "pass --overwrite" in capsys.readouterr().err
    assert out.read_text() == "old"
    assert _run(*args, "--overwrite") == 0
    assert isinstance(gm.load_curvature(out), gm.Diagonal)
    (workdir / "a-folder").mkdir()
    with pytest.raises(SystemExit):
        _run(args[0], args[1], str(workdir / "a-folder"))
    assert "is a folder; give a file name" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a folder that holds MODEL: the collision is said first
        _run(args[0], args[1], str(workdir))
    assert f"OUT {workdir} contains MODEL" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("model", "data", "error", "message"),
    [
        (
            "no_such_module_xyz:f",
            "cls.pt",
            gm.ArgumentError,
            "no module named 'no_such_module_xyz'",
        ),
        ("gm_test_entry:missing", "cls.pt", gm.ArgumentError, "has no 'missing'"),
        ("gm_test_entry:NOT_CALLABLE", "cls.pt", gm.ArgumentError, "expected a function"),
        ("gm_test_entry:not_a_model", "cls.pt", gm.ArgumentError, "expected a torch.nn.Module"),
        ("nofile.py:f", "cls.pt", gm.ArgumentError, "no Python file at nofile.py"),
        (
            "gm_test_entry:mlp",
            "gm_test_entry:not_batches",
            gm.ArgumentError,
            "expected an iterable of batches",
        ),
        ("gm_test_entry:mlp", "names.pt", gm.FileFormatError, "expected 'inputs' and 'targets'"),
        ("gm_test_entry:mlp", "rows.pt", gm.StructureError, "same number of examples"),
        ("gm_test_entry:mlp", "list.pt", gm.FileFormatError, "expected a dict of named tensors"),
        ("gm_test_entry:mlp", "corrupt.safetensors", gm.FileFormatError, "cannot be read"),
        ("gm_test_entry:mlp", "gm_test_entry:nan_batches", gm.NonFiniteError, "batch 0"),
    ],
)
def test_bad_inputs_raise_typed_errors_and_write_nothing(
    workdir, monkeypatch, capsys, model, data, error, message
):
    """The command reports them on one line and exits 1; underneath, each is a typed error."""
    monkeypatch.chdir(workdir)
    torch.save({"x": torch.zeros(2, 3), "y": torch.zeros(2)}, "names.pt")
    torch.save({"inputs": torch.zeros(2, 3), "targets": torch.zeros(3)}, "rows.pt")
    torch.save([torch.zeros(2)], "list.pt")
    (workdir / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    assert _run(model, data, "out.safetensors") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gradmerge curvature: error:") and message in err[-1]
    with pytest.raises(error, match=message):
        _execute(model, data, "out.safetensors")
    assert not (workdir / "out.safetensors").exists()
    assert not list(workdir.glob(".out.safetensors.*"))  # no temporary left behind


def test_kfac_refuses_a_one_shot_iterator_through_the_progress_bar(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    with pytest.raises(gm.ArgumentError, match="one-shot iterator"):
        _execute("gm_test_entry:mlp", "gm_test_entry:one_shot", "k.st", "--structure", "kfac")


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "has no config.json"),
        ({"config.json": "{}"}, "names no 'architectures'"),
        ({"config.json": '{"architectures": ["NoSuchModelXyz"]}'}, "has no class 'NoSuchModelXyz'"),
        ({"config.json": '{"architectures": ["GPT2LMHeadModel"]}'}, "holds no safetensors"),
    ],
)
def test_bad_hugging_face_folders(workdir, files, message):
    folder = workdir / "hf"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    with pytest.raises(gm.FileFormatError, match=message):
        _execute(str(folder), str(workdir / "cls.pt"), str(workdir / "o.safetensors"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_an_argparse_error(workdir, capsys):
    with pytest.raises(SystemExit):
        _run(f"{workdir}/gm_test_entry.py:mlp", str(workdir / "cls.pt"), "o.st", "--device", "cuda")
    assert "no CUDA device is available" in capsys.readouterr().err
