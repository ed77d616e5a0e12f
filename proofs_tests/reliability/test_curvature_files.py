"""Issue 13, cases 5 and 8: curvature files.

5: a curvature file whose metadata nests its structure 50,000 levels deep raised an uncaught
RecursionError; now a FileFormatError (at any depth above the limit, also one that parses).
8: a curvature records a sample hash of the weights it was estimated at; a merge that pairs it
with other weights warns (or refuses, with ``curvature_weights: refuse``).
"""

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

import gradmerge as gm
from gradmerge import cli
from gradmerge.curvature.io import open_curvature
from gradmerge.curvature.provenance import META_KEY, sample_hash
from gradmerge.errors import ConfigError
from gradmerge.jobs import MergeConfig, plan_merge, run_merge
from proofs_tests.workspace import make_workspace

MAX_SPEC_DEPTH = 32  # gradmerge.curvature.spec.MAX_SPEC_DEPTH


def _nested(tmp_path, depth: int):
    path = gm.Diagonal({"w": torch.ones(2)}).save(tmp_path / "c.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    meta["spec"] = '{"type": "blocks", "parts": [' * depth + meta["spec"] + "]}" * depth
    tensors = {"blocks0/" * depth + k: v for k, v in tensors.items()}
    out = tmp_path / f"deep{depth}.safetensors"
    save_file(tensors, out, metadata=meta)
    return out


@pytest.mark.parametrize("depth", [50_000, 900, MAX_SPEC_DEPTH])
def test_case5_deeply_nested_spec_is_a_file_format_error(tmp_path, depth):
    path = _nested(tmp_path, depth)
    with pytest.raises(gm.FileFormatError, match="nests more than 32 levels deep"):
        gm.load_curvature(path)
    with pytest.raises(gm.FileFormatError, match="nests more than 32 levels deep"):
        open_curvature(path)


def test_case5_nesting_within_the_limit_still_loads(tmp_path):
    # the innermost diagonal under MAX_SPEC_DEPTH - 1 one-block levels: a legal file
    path = _nested(tmp_path, MAX_SPEC_DEPTH - 1)
    c = gm.load_curvature(path)
    torch.testing.assert_close(c.mv({"w": torch.ones(2)})["w"], torch.ones(2))


# ----- case 8 ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("weights-hash"), "diag")


def _merge_config(ws, curvatures, **extra):
    models = [
        {"model": m.name, "curvature": c.name} for m, c in zip(ws.models, curvatures, strict=True)
    ]
    data = {
        "method": "gradient_matching",
        "base_model": "base.safetensors",
        "models": models,
        "prior": {"delta": 1.0e-2},
        **extra,
    }
    return MergeConfig.from_dict(data, root=ws.root)


def _input_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, gm.InputWarning)]


def test_case8_estimate_records_a_sample_hash_of_the_weights(ws):
    c = gm.load_curvature(ws.curvatures[0])
    ft = ws.load(ws.models[0])
    assert c.meta[META_KEY] == sample_hash(ft, [k for k, _ in c.layout])
    assert c.meta[META_KEY] != sample_hash(ws.load(ws.models[1]), [k for k, _ in c.layout])


def test_case8_matching_curvatures_do_not_warn(ws, tmp_path, recwarn):
    plan_merge(_merge_config(ws, ws.curvatures))
    # a curvature estimated at the base is also a valid pairing (H_t at θ_LLM)
    plan_merge(_merge_config(ws, [ws.base_curvature, ws.curvatures[1]]))
    # and a bfloat16 copy of the same weights matches
    bf16 = {k: v.to(torch.bfloat16) for k, v in ws.load(ws.models[0]).items()}
    save_file(bf16, ws.root / "ft0-bf16.safetensors")
    cfg = MergeConfig.from_dict(
        {
            "method": "gradient_matching",
            "base_model": "base.safetensors",
            "models": [
                {"model": "ft0-bf16.safetensors", "curvature": ws.curvatures[0].name},
                {"model": ws.models[1].name, "curvature": ws.curvatures[1].name},
            ],
            "prior": {"delta": 1.0e-2},
            "allow_mixed_dtypes": True,
        },
        root=ws.root,
    )
    run_merge(cfg, tmp_path / "out", progress=False)
    assert _input_warnings(recwarn) == []


def test_case8_swapped_curvatures_warn_by_default(ws, tmp_path):
    swapped = [ws.curvatures[1], ws.curvatures[0]]
    with pytest.warns(gm.InputWarning) as record:
        run_merge(_merge_config(ws, swapped), tmp_path / "out", progress=False)
    messages = _input_warnings(record)
    assert len(messages) == 2
    assert (
        "`models[0].curvature`" in messages[0]
        and "other weights than `models[0].model`" in messages[0]
    )
    assert (tmp_path / "out").is_dir()  # a warning: the merge still ran


def test_case8_swapped_curvatures_are_refused_on_request(ws, tmp_path, capsys):
    swapped = [ws.curvatures[1], ws.curvatures[0]]
    cfg = _merge_config(ws, swapped, curvature_weights="refuse")
    with pytest.raises(ConfigError, match="curvature_weights: ignore"):
        run_merge(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    data = {
        "method": "gradient_matching",
        "base_model": "base.safetensors",
        "models": [
            {"model": m.name, "curvature": c.name} for m, c in zip(ws.models, swapped, strict=True)
        ],
        "prior": {"delta": 1.0e-2},
        "curvature_weights": "refuse",
    }
    (ws.root / "refuse.yaml").write_text(yaml.safe_dump(data))
    assert cli.main(["merge", str(ws.root / "refuse.yaml"), str(tmp_path / "o"), "--dry-run"]) == 1
    assert "was estimated at other weights" in capsys.readouterr().err


def test_case8_ignore_and_files_without_a_hash_are_silent(ws, tmp_path, recwarn):
    swapped = [ws.curvatures[1], ws.curvatures[0]]
    plan_merge(_merge_config(ws, swapped, curvature_weights="ignore"))
    # a hand-made curvature records no hash: nothing to judge
    hand = gm.Diagonal({k: torch.ones_like(v) for k, v in ws.load(ws.base).items()})
    hand.save(ws.root / "hand.curvature.safetensors")
    plan_merge(
        _merge_config(
            ws,
            [
                ws.root / "hand.curvature.safetensors",
                ws.curvatures[1],
            ],
        )
    )
    assert _input_warnings(recwarn) == []
