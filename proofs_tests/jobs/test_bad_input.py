"""Bad input to the streaming engine: a typed error that names the tensor, and nothing written."""

import pytest
import torch
from safetensors.torch import load_file, save_file

import gradmerge as gm
from gradmerge.errors import ConfigError, OutputExistsError, OutputOverlapError
from gradmerge.io import writer
from gradmerge.jobs import MergeConfig, RemoveConfig, run_merge, run_remove
from proofs_tests.workspace import make_workspace


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("kfac"), "kfac")


def _gm_config(ws, **changes):
    return MergeConfig.from_dict(ws.merge_dict(**changes), root=ws.root)


def _variant(ws, tmp_path, name, change):
    """A copy of fine-tune 0 with ``change`` applied to its tensor dict."""
    tensors = load_file(ws.models[0])
    change(tensors)
    path = tmp_path / name
    save_file(tensors, path)
    return path


def _nothing_written(tmp_path, out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_mismatched_keys_shapes_and_dtypes_name_the_tensor(ws, tmp_path):
    out = tmp_path / "out"
    cases = [
        (
            "missing.safetensors",
            lambda t: t.pop("3.bias"),
            gm.StructureError,
            r"lacks 1 tensor.*'3.bias'",
        ),
        ("extra.safetensors", lambda t: t.update(head=torch.ones(2)), gm.StructureError, r"'head'"),
        (
            "shape.safetensors",
            lambda t: t.update({"0.weight": torch.ones(4, 6)}),
            gm.StructureError,
            r"shape \(4, 6\) for '0.weight' but the base has \(4, 5\)",
        ),
        (
            "dtype.safetensors",
            lambda t: t.update({"2.bias": t["2.bias"].double()}),
            gm.DTypeError,
            r"stores '2.bias' as torch.float64 but the base as torch.float32.*allow_mixed_dtypes",
        ),
    ]
    for name, change, error, message in cases:
        path = _variant(ws, tmp_path, name, change)
        config = _gm_config(ws, models=[{"model": str(path), "curvature": str(ws.curvatures[0])}])
        with pytest.raises(error, match=message):
            run_merge(config, out, progress=False)
        _nothing_written(tmp_path, out)


def test_mixed_float_dtypes_when_allowed(ws, tmp_path):
    path = _variant(
        ws, tmp_path, "f64.safetensors", lambda t: t.update({"2.bias": t["2.bias"].double()})
    )
    models = [{"model": str(path), "curvature": str(ws.curvatures[0])}]
    run_merge(
        _gm_config(ws, models=models, allow_mixed_dtypes=True), tmp_path / "out", progress=False
    )
    assert load_file(tmp_path / "out" / "model.safetensors")["2.bias"].dtype == torch.float32


def test_a_parameter_without_curvature(ws, tmp_path):
    models = []
    for t, (m, c) in enumerate(zip(ws.models, ws.curvatures, strict=True)):
        blocks = gm.load_curvature(c).blocks
        kfac = next(b for b in blocks if isinstance(b, gm.KFAC))  # without the LayerNorm ("2.*")
        partial = kfac.save(tmp_path / f"partial{t}.curvature.safetensors")
        models.append({"model": m.name, "curvature": str(partial)})
    with pytest.raises(
        gm.StructureError, match=r"no curvature for '2\.(bias|weight)' and 1 more.*passthrough"
    ):
        run_merge(_gm_config(ws, models=models), tmp_path / "out", progress=False)
    _nothing_written(tmp_path, tmp_path / "out")
    # the fix the message names: copy them from the base
    run_merge(_gm_config(ws, models=models, passthrough=["2.*"]), tmp_path / "out", progress=False)
    out, base = load_file(tmp_path / "out" / "model.safetensors"), load_file(ws.base)
    assert torch.equal(out["2.weight"], base["2.weight"]) and torch.equal(
        out["2.bias"], base["2.bias"]
    )
    assert not torch.equal(out["0.weight"], base["0.weight"])


def test_passthrough_cannot_split_a_coupled_layer_or_match_nothing(ws, tmp_path):
    with pytest.raises(
        gm.StructureError, match=r"couples '0.weight' with '0.bias'.*passed through"
    ):
        run_merge(_gm_config(ws, passthrough=["0.bias"]), tmp_path / "out", progress=False)
    with pytest.raises(ConfigError, match=r"'lm_head\*' matches no tensor"):
        run_merge(_gm_config(ws, passthrough=["lm_head*"]), tmp_path / "out", progress=False)


def test_curvature_of_another_model(ws, tmp_path):
    other = gm.Diagonal({"0.weight": torch.ones(3, 5), "0.bias": torch.ones(3)})
    path = other.save(tmp_path / "other.curvature.safetensors")
    models = [{"model": ws.models[0].name, "curvature": str(path)}]
    with pytest.raises(
        gm.StructureError, match=r"shape \(3, 5\) for '0.weight' but the base has \(4, 5\)"
    ):
        run_merge(_gm_config(ws, models=models), tmp_path / "out", progress=False)


def test_removal_with_a_singular_remaining_curvature_suggests_delta(ws, tmp_path):
    values = {k: torch.ones_like(v) for k, v in load_file(ws.base).items()}
    values["3.bias"][0] = 0.0  # a direction the remaining data does not constrain
    rest = gm.Diagonal(values).save(tmp_path / "rest.curvature.safetensors")
    config = RemoveConfig.from_dict(
        {
            "method": "influence_remove",
            "base_model": "base.safetensors",
            "gradient": "gradient.safetensors",
            "remaining": {"curvature": str(rest)},
        },
        root=ws.root,
    )
    with pytest.raises(
        gm.NotPositiveDefiniteError, match=r"'3.bias'.*remaining: \{delta: \.\.\.\}"
    ):
        run_remove(config, tmp_path / "out", progress=False)
    _nothing_written(tmp_path, tmp_path / "out")


def test_corrupt_and_truncated_inputs(ws, tmp_path):
    good = ws.base.read_bytes()
    cases = {
        "truncated.safetensors": good[:-40],
        "junk.safetensors": b"\x10\x00\x00\x00\x00\x00\x00\x00{not json header}",
        "short.safetensors": b"\x01\x02",
        "huge-header.safetensors": (10**9).to_bytes(8, "little") + b"{}",
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(gm.FileFormatError, match=name):
            run_merge(
                _gm_config(ws, base_model=str(tmp_path / name)), tmp_path / "out", progress=False
            )
        _nothing_written(tmp_path, tmp_path / "out")
    bad = tmp_path / "bad.curvature.safetensors"
    bad.write_bytes(ws.curvatures[0].read_bytes()[:-8])
    models = [{"model": ws.models[0].name, "curvature": str(bad)}]
    with pytest.raises(gm.FileFormatError, match="truncated or corrupt"):
        run_merge(_gm_config(ws, models=models), tmp_path / "out", progress=False)


def test_existing_output_is_refused_and_replaced_only_when_asked(ws, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="pass overwrite=True to replace it"):
        run_merge(_gm_config(ws), out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    run_merge(_gm_config(ws), out, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folders left


def test_output_inside_an_input_is_refused(ws, tmp_path):
    with pytest.raises(OutputOverlapError, match="contains base_model"):
        run_merge(_gm_config(ws), ws.root, overwrite=True, progress=False)
    assert ws.base.is_file()


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_an_interrupted_merge_leaves_nothing(ws, tmp_path, monkeypatch, error):
    out = tmp_path / "out"
    out.mkdir()
    (out / "previous.txt").write_text("an earlier result")
    calls = []
    original = writer.ShardedWriter.write

    def failing(self, name, tensor):
        calls.append(name)
        if len(calls) == 3:
            raise error
        original(self, name, tensor)

    monkeypatch.setattr(writer.ShardedWriter, "write", failing)
    config = _gm_config(ws, max_shard_size=200)  # several shards: one is complete when it fails
    with pytest.raises(type(error)):
        run_merge(config, out, overwrite=True, progress=False)
    assert len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in out.iterdir()] == ["previous.txt"]  # the old output is untouched


def test_float16_overflow_is_named(ws, tmp_path):
    big = _variant(
        ws, tmp_path, "big.safetensors", lambda t: t.update({"3.bias": t["3.bias"] + 1e6})
    )
    config = MergeConfig.from_dict(
        {
            "method": "task_arithmetic",
            "base_model": str(ws.base),
            "models": [{"model": str(big)}],
            "dtype": "float16",
        }
    )
    with pytest.raises(gm.NonFiniteError, match=r"'3.bias' overflows the output dtype float16"):
        run_merge(config, tmp_path / "out", progress=False)
    _nothing_written(tmp_path, tmp_path / "out")


def test_nan_in_an_input_is_named(ws, tmp_path):
    nan = _variant(
        ws, tmp_path, "nan.safetensors", lambda t: t["2.weight"].__setitem__(0, float("nan"))
    )
    models = [{"model": str(nan), "curvature": str(ws.curvatures[0])}]
    with pytest.raises(gm.NonFiniteError, match=r"finetuned\[0\]\['2.weight'\].*while computing"):
        run_merge(_gm_config(ws, models=models), tmp_path / "out", progress=False)


def test_a_gradient_file_must_cover_the_parameters(ws, tmp_path):
    grads = load_file(ws.gradient)
    grads.pop("0.bias")
    path = tmp_path / "grad.safetensors"
    save_file(grads, path)
    config = RemoveConfig.from_dict(
        {
            "method": "influence_remove",
            "base_model": str(ws.base),
            "gradient": str(path),
            "remaining": {"delta": 1.0},
        }
    )
    with pytest.raises(gm.StructureError, match=r"no gradient for '0.bias'"):
        run_remove(config, tmp_path / "out", progress=False)


def test_devices():
    from gradmerge import demo
    from gradmerge.errors import DeviceUnavailableError
    from gradmerge.foundation.devices import resolve_device

    # one helper for the library, the commands, the demo and the ranks
    assert demo.resolve_device is resolve_device
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected and resolve_device("cpu").type == "cpu"
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(gm.ArgumentError, match="'auto', 'cpu' or 'cuda"):
        resolve_device("tpu")
    assert issubclass(DeviceUnavailableError, gm.ArgumentError)
    assert issubclass(DeviceUnavailableError, gm.DeviceError)
    if not torch.cuda.is_available():
        with pytest.raises(gm.ArgumentError, match="CUDA is not available: use cpu or auto"):
            resolve_device("cuda:0")
    else:
        with pytest.raises(gm.ArgumentError, match="CUDA devices"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
