"""`gradmerge convert-curvature` + `gradmerge merge` reproduce the paper's official merge script.

Oracle: a transcription of the merge loop of the official code's
code/uncertainty_based_gradient_matching.py (UKPLab/iclr2024-model-merging), run on the same tiny
BERT folders: state dicts from ``from_pretrained``, a loop over the new model's named parameters,
H̄⁻¹ = 1 / (Σ_t λ κ_t F_t + s F_0 + δ), θ = θ_0 + λ Σ_t H̄⁻¹ (κ_t F_t + δ + s F_0)(θ_t − θ_0).
Fisher folders are written as the official trainer writes them (``save_model`` of a model whose
weights are the Fisher values), in the three layouts: model.safetensors, sharded safetensors,
pytorch_model.bin.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file, save_file

import gradmerge as gm
from gradmerge import cli

LAMBDA, KAPPAS, S_PT, DELTA = 0.7, (3.0, 0.5), 2.0, 1e-3


def _config():
    return transformers.BertConfig(
        vocab_size=30,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=12,
        max_position_embeddings=16,
        num_labels=2,
    )


def _model(seed):
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(_config())


def _fisher_model(seed):
    """A model whose weights are non-negative 'Fisher values' (a fifth of them 0)."""
    model = _model(seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            values = torch.rand(p.shape, generator=g) ** 3 * 10.0
            p.copy_(values * (torch.rand(p.shape, generator=g) > 0.2))
    return model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("official")
    base = _model(0)
    base.save_pretrained(root / "base")
    for t in (1, 2):
        ft = _model(0)
        with torch.no_grad():
            for p in ft.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(t)))
        ft.save_pretrained(root / f"ft{t}")
    _fisher_model(11).save_pretrained(root / "ft1-fisher" / "hessian")  # model.safetensors
    _fisher_model(12).save_pretrained(root / "base-fisher" / "hessian", max_shard_size="20KB")
    pickled = root / "ft2-fisher" / "hessian"  # pytorch_model.bin, as older transformers wrote
    pickled.mkdir(parents=True)
    torch.save(_fisher_model(13).state_dict(), pickled / "pytorch_model.bin")
    _config().save_pretrained(pickled)
    return root


def _state_dict(folder):
    """What the official script's ``model_class.from_pretrained(path).state_dict()`` gives."""
    if (folder / "pytorch_model.bin").is_file():  # transformers 5 reads safetensors only
        model = transformers.BertForSequenceClassification(_config())
        model.load_state_dict(torch.load(folder / "pytorch_model.bin", weights_only=True))
        return model.state_dict()
    return transformers.BertForSequenceClassification.from_pretrained(folder).state_dict()


def official_merge(runs):
    """The official script's merge loop, transcribed (scaling_factor λ, scaling_factors_ft κ,
    scaling_factor_pt s, delta_0 δ)."""
    pretrained_model = _state_dict(runs / "base")
    pretrained_hessian = _state_dict(runs / "base-fisher" / "hessian")
    ft_models = [_state_dict(runs / f"ft{t}") for t in (1, 2)]
    ft_hessians = [_state_dict(runs / f"ft{t}-fisher" / "hessian") for t in (1, 2)]
    new_model = transformers.BertForSequenceClassification.from_pretrained(runs / "base")
    merged = {}
    with torch.no_grad():
        for n, p in new_model.named_parameters():
            merged[n] = pretrained_model[n]
            if not ("position_ids" in n or "attn.masked_bias" in n or p.dtype == torch.bool):
                preconditioner = 1.0 / (
                    sum(
                        float(LAMBDA) * float(k) * h[n]
                        for h, k in zip(ft_hessians, KAPPAS, strict=True)
                    )
                    + float(S_PT) * pretrained_hessian[n]
                    + DELTA
                )
                summed = sum(
                    (
                        preconditioner
                        * (float(k) * h[n] + DELTA + float(S_PT) * pretrained_hessian[n])
                    )
                    * (m[n] - pretrained_model[n])
                    for m, h, k in zip(ft_models, ft_hessians, KAPPAS, strict=True)
                )
                merged[n] = merged[n] + float(LAMBDA) * summed
    return merged


def _convert(*argv):
    return cli.main(["convert-curvature", *map(str, argv)])


def test_converted_curvatures_reproduce_the_official_merge(runs, tmp_path):
    for name, src, scale in (
        ("F1", runs / "ft1-fisher", KAPPAS[0]),  # the run folder: its hessian/ is used
        ("F2", runs / "ft2-fisher" / "hessian", KAPPAS[1]),
        ("F0", runs / "base-fisher" / "hessian", S_PT),
    ):
        assert _convert(src, tmp_path / f"{name}.safetensors", "--scale", scale) == 0
    config = {
        "method": "gradient_matching",
        "base_model": str(runs / "base"),
        "models": [
            {"model": str(runs / f"ft{t}"), "curvature": f"F{t}.safetensors", "alpha": LAMBDA}
            for t in (1, 2)
        ],
        "prior": {"delta": DELTA, "curvature": "F0.safetensors"},
    }
    (tmp_path / "merge.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["merge", str(tmp_path / "merge.yaml"), str(tmp_path / "merged")]) == 0
    ours = load_file(str(tmp_path / "merged" / "model.safetensors"))
    expected = official_merge(runs)
    assert set(expected) <= set(ours)
    for name, value in expected.items():
        torch.testing.assert_close(ours[name], value, rtol=2e-6, atol=2e-7, msg=name)
    changed = [n for n, v in expected.items() if not torch.equal(v, _state_dict(runs / "base")[n])]
    assert len(changed) == len(expected)  # every parameter moved: the test sees each of them


def test_the_file_is_the_scaled_fisher_with_provenance(runs, tmp_path):
    out = tmp_path / "F.safetensors"
    assert _convert(runs / "ft1-fisher" / "hessian", out, "--scale", 3, "--num-examples", 50) == 0
    c = gm.load_curvature(out)
    fisher = _state_dict(runs / "ft1-fisher" / "hessian")
    params = dict(_fisher_model(11).named_parameters())
    assert sorted(c.values) == sorted(params)  # the parameters: no buffer
    for name, value in c.values.items():
        torch.testing.assert_close(value, 3.0 * fisher[name], rtol=0, atol=0)
    assert c.meta["num_examples"] == "50"
    assert c.meta["source.scale"] == "3.0"
    assert c.meta["source.converted_from"] == str((runs / "ft1-fisher" / "hessian").resolve())


def test_buffers_are_left_out_as_the_official_script_does(tmp_path):
    save_file(
        {
            "w": torch.ones(3),
            "embeddings.position_ids": torch.arange(4),
            "h.0.attn.masked_bias": torch.tensor(-1e4),
            "h.0.attn.bias": torch.ones(2, 2, dtype=torch.bool),
            "half": torch.ones(2, dtype=torch.float16),
        },
        tmp_path / "f.safetensors",
    )
    assert _convert(tmp_path / "f.safetensors", tmp_path / "o.safetensors") == 0
    c = gm.load_curvature(tmp_path / "o.safetensors")
    assert sorted(c.values) == ["half", "w"]
    assert c.values["half"].dtype == torch.float32  # 16-bit values are widened before scaling


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"w": torch.tensor([1.0, -0.5, 2.0])}, "w holds 1 negative value(s)"),
        ({"w": torch.tensor([1.0, float("nan")])}, "w holds 1 NaN/Inf value(s)"),
        ({"w": torch.tensor([float("inf")])}, "w holds 1 NaN/Inf value(s)"),
        ({"w": torch.tensor([6e4], dtype=torch.float16)}, None),  # widened: 6e4 × 10 fits
        ({"w": torch.tensor([3e38])}, "overflows torch.float32 once scaled by 10"),
        ({"ids": torch.arange(3)}, "holds no floating-point tensors"),
    ],
)
def test_bad_values_are_typed_errors_and_write_nothing(tmp_path, capsys, values, message):
    save_file(values, tmp_path / "f.safetensors")
    code = _convert(tmp_path / "f.safetensors", tmp_path / "o.safetensors", "--scale", "10")
    if message is None:
        assert code == 0
        return
    assert code == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickles_are_read_with_weights_only(tmp_path, capsys):
    marker = tmp_path / "pwned"
    folder = tmp_path / "hessian"
    folder.mkdir()
    torch.save({"w": torch.ones(2), "x": _Payload(str(marker))}, folder / "pytorch_model.bin")
    assert _convert(folder, tmp_path / "o.safetensors") == 1
    err = capsys.readouterr().err
    assert "weights_only=True" in err and "never runs pickled code" in err
    assert not marker.exists()
    assert not (tmp_path / "o.safetensors").exists()
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    assert _convert(tmp_path / "list.pt", tmp_path / "o.safetensors") == 1
    assert "expected a state dict" in capsys.readouterr().err


def test_missing_inputs_are_named(tmp_path, capsys):
    assert _convert(tmp_path / "nowhere", tmp_path / "o.safetensors") == 1
    assert "no curvature at" in capsys.readouterr().err
    folder = tmp_path / "sharded"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "pytorch_model-00001-of-00002.bin")
    (folder / "pytorch_model.bin.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "w": "pytorch_model-00001-of-00002.bin",
                    "v": "pytorch_model-00002-of-00002.bin",
                }
            }
        )
    )
    assert _convert(folder, tmp_path / "o.safetensors") == 1
    assert "pytorch_model-00002-of-00002.bin" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert _convert(tmp_path / "empty", tmp_path / "o.safetensors") == 1
    assert "holds no .safetensors weights" in capsys.readouterr().err


def test_a_curvature_missing_a_parameter_fails_the_merge_by_name(runs, tmp_path, capsys):
    fisher = {
        k: v
        for k, v in _state_dict(runs / "ft1-fisher" / "hessian").items()
        if k != "classifier.weight"
    }
    save_file(fisher, tmp_path / "partial.safetensors")
    assert _convert(tmp_path / "partial.safetensors", tmp_path / "F1.safetensors") == 0
    config = {
        "method": "gradient_matching",
        "base_model": str(runs / "base"),
        "models": [{"model": str(runs / "ft1"), "curvature": "F1.safetensors"}],
        "prior": {"delta": DELTA},
    }
    (tmp_path / "merge.yaml").write_text(yaml.safe_dump(config))
    code = cli.main(["merge", str(tmp_path / "merge.yaml"), str(tmp_path / "merged")])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "classifier.weight" in err
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--scale", "0"], "--scale must be a positive finite number"),
        (["--scale", "-1"], "--scale must be a positive finite number"),
        (["--scale", "nan"], "--scale must be a positive finite number"),
        (["--num-examples", "0"], "--num-examples must be at least 1"),
    ],
)
def test_bad_flags_are_usage_errors(runs, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        _convert(runs / "ft1-fisher", tmp_path / "o.safetensors", *flags)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_an_existing_output_needs_overwrite(runs, tmp_path, capsys):
    out = tmp_path / "o.safetensors"
    out.write_text("keep")
    with pytest.raises(SystemExit):
        _convert(runs / "ft1-fisher", out)
    assert "pass --overwrite" in capsys.readouterr().err
    assert out.read_text() == "keep"
    assert _convert(runs / "ft1-fisher", out, "--overwrite") == 0
    assert gm.load_curvature(out).values
