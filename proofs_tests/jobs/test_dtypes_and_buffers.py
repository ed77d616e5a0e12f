"""bf16 inputs merge in float32 and are written in `dtype`; buffers pass through from the base."""

import pytest
import torch
from safetensors.torch import load_file

import gradmerge as gm
from gradmerge.io import open_checkpoint
from gradmerge.jobs import MergeConfig, run_merge
from proofs_tests.workspace import assert_same, make_workspace

BUFFERS = {
    "embed.position_ids": torch.arange(8)[None, :],  # int64, like transformers' buffers
    "attn.mask": torch.tril(torch.ones(3, 3, dtype=torch.bool)),
    "norm.running_mean": torch.linspace(-1, 1, 4),  # a float buffer: passed through by name
}


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return make_workspace(
        tmp_path_factory.mktemp("bf16"), "diag", dtype=torch.bfloat16, buffers=BUFFERS
    )


def _config(ws, **changes):
    config = ws.merge_dict(**{"passthrough": ["*.running_mean"], **changes})
    return MergeConfig.from_dict(config, root=ws.root)


def _reference(ws):
    """Whole state dicts upcast to float32, merged in memory."""

    def params(path):
        return {k: v for k, v in ws.load(path, torch.float32).items() if k not in BUFFERS}

    base, fts = params(ws.base), [params(m) for m in ws.models]
    hs = [ws.curvature(c) for c in ws.curvatures]
    return gm.gradient_matching(base, fts, hs, prior=1e-2)


@pytest.mark.parametrize("dtype", [None, "float32", "float16"])
def test_bf16_inputs_merge_in_float32_and_are_written_in_dtype(bf16, tmp_path, dtype):
    report = run_merge(_config(bf16, dtype=dtype), tmp_path / "out", progress=False)
    out = load_file(tmp_path / "out" / "model.safetensors")
    written = {None: torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    expected = {k: v.to(written) for k, v in _reference(bf16).items()}
    assert_same(out, expected)
    assert {out[k].dtype for k in expected} == {written}
    assert report.merged == len(expected) and report.copied == len(BUFFERS)


def test_buffers_pass_through_unchanged(bf16, tmp_path):
    run_merge(_config(bf16, dtype="float32"), tmp_path / "out", progress=False)
    out = load_file(tmp_path / "out" / "model.safetensors")
    for k, v in BUFFERS.items():
        expected = v.float() if k == "norm.running_mean" else v  # float tensors take `dtype`
        assert out[k].dtype == expected.dtype and torch.equal(out[k], expected), k


def test_a_float_buffer_without_curvature_needs_passthrough(bf16, tmp_path):
    with pytest.raises(
        gm.StructureError, match=r"no curvature for 'norm.running_mean'.*passthrough"
    ):
        run_merge(_config(bf16, passthrough=[]), tmp_path / "out", progress=False)
    # task arithmetic needs no curvature: the float buffer is merged like a parameter
    config = MergeConfig.from_dict(
        {
            "method": "task_arithmetic",
            "base_model": "base.safetensors",
            "models": [{"model": "ft0.safetensors"}],
        },
        root=bf16.root,
    )
    run_merge(config, tmp_path / "ta", progress=False)
    assert torch.equal(
        load_file(tmp_path / "ta" / "model.safetensors")["embed.position_ids"],
        BUFFERS["embed.position_ids"],
    )


def test_sharded_output_round_trips(bf16, tmp_path):
    run_merge(_config(bf16, max_shard_size=64), tmp_path / "out", progress=False)
    out_dir = tmp_path / "out"
    shards = sorted(out_dir.glob("model-*.safetensors"))
    assert len(shards) > 1
    for shard in shards:  # at most 64 bytes of data, unless one tensor alone is larger
        with open_checkpoint(shard) as part:
            assert part.total_bytes <= 64 or len(part) == 1, (shard.name, part.total_bytes)
    with open_checkpoint(out_dir) as ckpt:
        merged = {k: ckpt.get(k) for k in ckpt}
    single = tmp_path / "single"
    run_merge(_config(bf16), single, progress=False)
    assert_same(merged, load_file(single / "model.safetensors"))
