"""Hugging Face folders in and out: shards with an index, config/tokenizer files, from_pretrained."""

import json

import pytest
import torch

import gradmerge as gm
from gradmerge.io import open_checkpoint
from gradmerge.jobs import MergeConfig, run_merge
from proofs_tests.workspace import assert_same

transformers = pytest.importorskip("transformers")


def _state(folder):
    """The model's parameters as transformers loads them (an independent reader)."""
    model = transformers.GPT2LMHeadModel.from_pretrained(folder)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_a_sharded_folder_reads_like_the_model(hf_models):
    with open_checkpoint(hf_models.models[1]) as ckpt:
        assert len(ckpt.files) > 1 and all(f.name.startswith("model-") for f in ckpt.files)
        expected = _state(hf_models.models[1])
        assert set(ckpt.keys()) == set(expected)
        for k, v in expected.items():
            assert ckpt.shape(k) == tuple(v.shape) and ckpt.dtype(k) == v.dtype
            torch.testing.assert_close(ckpt.get(k), v, rtol=0, atol=0)
        assert ckpt.bytes_read == sum(v.numel() * 4 for v in expected.values())
    with open_checkpoint(hf_models.base) as ckpt:
        assert [p.name for p in ckpt.assets()] == [
            "config.json",
            "generation_config.json",
            "tokenizer_config.json",
        ]


def test_gradient_matching_on_hf_folders(hf_models, tmp_path):
    """K-FAC with GPT-2's transposed Conv1D layers, a sharded input, a sharded output that
    transformers loads back, equal to the in-memory merge of the models' parameters."""
    c = str(hf_models.curvature)
    config = MergeConfig.from_dict(
        {
            "method": "gradient_matching",
            "base_model": str(hf_models.base),
            "models": [
                {"model": str(hf_models.models[0]), "curvature": c, "alpha": 1.0},
                {"model": str(hf_models.models[1]), "curvature": c, "alpha": 0.5},
            ],
            "prior": {"delta": 1e-3},
            "max_shard_size": "5KB",
        }
    )
    out = tmp_path / "merged"
    report = run_merge(config, out, progress=False)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    assert report.bytes_written == sum((out / s).stat().st_size for s in shards)
    assert {p.name for p in report.files} == {p.name for p in out.iterdir()}

    merged = _state(out)  # transformers reads the shards through the index
    base, fts = _state(hf_models.base), [_state(m) for m in hf_models.models]
    h = gm.load_curvature(hf_models.curvature)
    expected = gm.gradient_matching(base, fts, [h, h], prior=1e-3, alphas=[1.0, 0.5])
    assert_same(merged, expected)

    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (hf_models.base / name).read_bytes()
    record = json.loads((out / "gradmerge_merge.json").read_text())
    assert record["method"] == "gradient_matching"
    assert record["effective_alphas"] == [1.0, 0.5]
    assert record["config"]["prior"] == {"delta": 1e-3, "curvature": None, "scale": 1.0}
    with open_checkpoint(hf_models.models[1]) as ckpt:
        assert record["inputs"]["models[1].model"]["header_sha256"] == ckpt.fingerprint
    fingerprints = {v["fingerprint_sha256"] for v in record["inputs"].values()}
    assert len(fingerprints) == len(record["inputs"])  # base and fine-tunes: different values
    assert record["curvatures"]["models[0].curvature"]["info"]["structure"] == "kfac"
    assert record["output"]["files"] == [*shards, "model.safetensors.index.json"]


def test_bfloat16_output_and_config_dtype(hf_models, tmp_path):
    config = MergeConfig.from_dict(
        {
            "method": "task_arithmetic",
            "base_model": str(hf_models.base),
            "models": [{"model": str(m), "alpha": 0.5} for m in hf_models.models],
            "dtype": "bfloat16",
        }
    )
    run_merge(config, tmp_path / "out", progress=False)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    base, fts = _state(hf_models.base), [_state(m) for m in hf_models.models]
    expected = gm.task_arithmetic(base, fts, alphas=0.5)  # float32 arithmetic, then cast
    got = dict(model.named_parameters())
    assert_same(
        {k: v.detach() for k, v in got.items()}, {k: v.bfloat16() for k, v in expected.items()}
    )
