"""Issue 21, item 1: a LoRA adapter is never applied silently over the wrong base model.

peft records the base as it was loaded, often a relative name such as ``base``. Run from a folder
that holds another ``base/``, ``gradmerge curvature ADAPTER ...`` used that model and exited 0.
Now a relative base is read beside the adapter; one that names another model relative to the
current directory is refused (:class:`AdapterBaseError`) until ``--adapter-base`` (or a YAML's
``adapter_base:``) names it; the base used and a fingerprint of its weights are recorded.
Reference: the curvature of the same adapter over the right base given by absolute path.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import gradmerge as gm
from gradmerge import cli
from gradmerge.curvature.provenance import sample_hash
from gradmerge.errors import AdapterBaseError
from gradmerge.io.sources import adapter_base
from proofs_tests.text_models import bert_classifier

QUERY = "bert.encoder.layer.0.attention.self.query"


def _adapter(folder, base_name):
    """A rank-2 LoRA adapter on the BERT query layer, its base recorded as ``base_name``."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(5)
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 2,
                "lora_alpha": 4,
                "target_modules": ["query"],
                "base_model_name_or_path": base_name,
            }
        )
    )
    save_file(
        {
            f"base_model.model.{QUERY}.lora_A.weight": torch.randn(2, 8, generator=g).double(),
            f"base_model.model.{QUERY}.lora_B.weight": torch.randn(8, 2, generator=g).double(),
        },
        folder / "adapter_model.safetensors",
    )
    return folder


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """project/{base, ad} (the adapter records "base") and elsewhere/base, another model."""
    root = tmp_path_factory.mktemp("adapter_base")
    bert_classifier(root / "project" / "base", seed=0)
    bert_classifier(root / "elsewhere" / "base", seed=1)
    _adapter(root / "project" / "ad", "base")
    rows = [{"text": "the movie was very good", "label": "positive"}, {"text": "a dull film"}]
    rows[1]["label"] = "negative"
    (root / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _curvature(root, out, *extra):
    argv = ["curvature", str(root / "project" / "ad"), str(root / "d.jsonl"), str(out)]
    return cli.main([*argv, "--no-progress", *extra])


def _meta(path):
    return gm.load_curvature(path).meta


def test_a_relative_base_is_read_beside_the_adapter(layout, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no base/ here
    assert adapter_base(layout / "project" / "ad") == layout / "project" / "base"
    assert _curvature(layout, tmp_path / "c.safetensors") == 0
    meta = _meta(tmp_path / "c.safetensors")
    base = layout / "project" / "base"
    assert meta["source.adapter_base"] == str(base.resolve())
    weights = load_file(str(base / "model.safetensors"))
    floats = [k for k, v in weights.items() if v.is_floating_point()]
    assert meta["source.adapter_base_weights_sample_sha256"] == sample_hash(weights, floats)


def test_another_base_in_the_current_folder_is_refused_not_used(
    layout, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(layout / "elsewhere")  # holds its own base/: the old code used it
    with pytest.raises(AdapterBaseError, match="cannot be told"):
        adapter_base(layout / "project" / "ad")
    out = tmp_path / "c.safetensors"
    assert _curvature(layout, out) == 1
    err = capsys.readouterr().err
    assert "cannot be told" in err and "--adapter-base" in err
    assert not out.exists()


def test_a_base_only_relative_to_the_current_folder_is_refused(tmp_path, monkeypatch, capsys):
    bert_classifier(tmp_path / "base")
    _adapter(tmp_path / "runs" / "ad", "base")  # nothing named base beside it
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AdapterBaseError, match="nothing beside it"):
        adapter_base(tmp_path / "runs" / "ad")


def test_the_flag_names_the_base_and_gives_the_right_curvature(layout, tmp_path, monkeypatch):
    reference = tmp_path / "reference.safetensors"
    monkeypatch.chdir(tmp_path)
    whole = "--whole-model"  # the adapter changes the query only; the bases differ elsewhere too
    assert _curvature(layout, reference, whole) == 0
    monkeypatch.chdir(layout / "elsewhere")
    for name, base in (
        ("right", layout / "project" / "base"),
        ("other", layout / "elsewhere" / "base"),
    ):
        out = tmp_path / f"{name}.safetensors"
        assert _curvature(layout, out, "--adapter-base", str(base), whole) == 0
        assert _meta(out)["source.adapter_base"] == str(base.resolve())
    a, b = load_file(str(reference)), load_file(str(tmp_path / "right.safetensors"))
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=1e-12, atol=1e-14, msg=key)
    # the other base is really another model: its curvature differs (what the old code returned)
    other = load_file(str(tmp_path / "other.safetensors"))
    assert max(float((other[k] - v).abs().max()) for k, v in a.items()) > 1e-3


def test_the_flag_applies_to_adapters_only(layout, tmp_path):
    argv = ["curvature", str(layout / "project" / "base"), str(layout / "d.jsonl")]
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, str(tmp_path / "c.safetensors"), "--adapter-base", str(layout)])
    assert exit_.value.code == 2


def _merge_yaml(path, base, model, **entry):
    config = {
        "method": "task_arithmetic",
        "base_model": str(base),
        "models": [{"model": str(model), **entry}],
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_merge_refuses_an_adapter_over_another_base(layout, tmp_path, monkeypatch, capsys):
    """The merge applies the adapter over base_model; its own base must be that model."""
    monkeypatch.chdir(tmp_path)
    ad, right, other = (
        layout / "project" / "ad",
        layout / "project" / "base",
        layout / "elsewhere" / "base",
    )
    config = _merge_yaml(tmp_path / "m.yaml", other, ad)
    assert cli.main(["merge", config, str(tmp_path / "out"), "--no-progress"]) == 1
    assert "whose weights differ from base_model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # a copy of the right base elsewhere is the same model: accepted
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "model.safetensors").write_bytes(
        (right / "model.safetensors").read_bytes()
    )
    config = _merge_yaml(tmp_path / "c.yaml", tmp_path / "copy", ad)
    assert cli.main(["merge", config, str(tmp_path / "ok"), "--no-progress"]) == 0
    # ambiguous from a folder with its own base/: refused, then named with adapter_base
    monkeypatch.chdir(layout / "elsewhere")
    config = _merge_yaml(tmp_path / "a.yaml", right, ad)
    assert cli.main(["merge", config, str(tmp_path / "amb"), "--no-progress"]) == 1
    assert "adapter_base" in capsys.readouterr().err
    config = _merge_yaml(tmp_path / "n.yaml", right, ad, adapter_base=str(right))
    assert cli.main(["merge", config, str(tmp_path / "named"), "--no-progress"]) == 0


def test_remove_checks_the_adapter_base_too(layout, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = {
        "method": "remove",
        "base_model": str(layout / "elsewhere" / "base"),
        "model": str(layout / "project" / "ad"),
        "curvature": str(tmp_path / "c.safetensors"),
        "prior": {"delta": 1.0},
        "remaining": {"delta": 1.0},
    }
    weights = load_file(str(layout / "project" / "base" / "model.safetensors"))
    gm.Diagonal({k: torch.ones_like(v) for k, v in weights.items() if v.is_floating_point()}).save(
        tmp_path / "c.safetensors"
    )
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["remove", str(tmp_path / "r.yaml"), str(tmp_path / "o"), "--no-progress"]) == 1
    assert "whose weights differ from base_model" in capsys.readouterr().err
    config["base_model"] = str(layout / "project" / "base")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["remove", str(tmp_path / "r.yaml"), str(tmp_path / "o"), "--no-progress"]) == 0
