"""Provenance: the fingerprint of each input in gradmerge_merge.json is a content hash.

Three checkpoints with identical headers (names, dtypes, shapes, offsets) but different values —
a base and two fine-tunes — must get three different fingerprints; the same values saved twice
(another file, another shard layout) the same one. The hash is checked against SHA-256 computed
here directly from the tensors' bytes.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import save_file

from gradmerge.io import fingerprint, open_checkpoint
from gradmerge.jobs import MergeConfig, run_merge


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb.weight": torch.randn(300, 256, generator=g),  # 76,800 entries: sampled rows
        "fc.weight": torch.randn(8, 5, generator=g),  # small: hashed whole
        "fc.bias": torch.randn(8, generator=g),
        "step": torch.tensor(3),  # 0-dim integer buffer
    }


def _direct(params: dict[str, torch.Tensor]) -> str:
    """The documented hash, written out independently of the implementation."""
    digest = hashlib.sha256()
    for key in sorted(params):
        t = params[key]
        dims = tuple(t.shape)
        digest.update(
            f"{key}:{str(t.dtype).removeprefix('torch.')}:{','.join(map(str, dims))};".encode()
        )
        if t.numel() > fingerprint.WHOLE:
            n, k = dims[0], fingerprint.CONTENT_ROWS
            t = t[sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})]
        digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()


def _fingerprint(path) -> str:
    with open_checkpoint(path) as c:
        return fingerprint.content_hash(c.keys(), c.shape, c.dtype, c.rows)


def test_content_hash_equals_the_documented_hash(tmp_path):
    params = _weights(0)
    save_file(params, tmp_path / "a.safetensors")
    assert _fingerprint(tmp_path / "a.safetensors") == _direct(params)


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p["emb.weight"].__setitem__((0, 0), p["emb.weight"][0, 0] + 1e-6),  # 1st row
        lambda p: p["emb.weight"].__setitem__((299, 255), 0.0),  # last row, last entry
        lambda p: p["fc.bias"].__setitem__(3, p["fc.bias"][3].nextafter(torch.tensor(9.0))),
        lambda p: p["step"].fill_(4),
    ],
    ids=["first-row", "last-row", "one-ulp-small-tensor", "buffer"],
)
def test_one_changed_value_changes_the_fingerprint(tmp_path, change):
    params = _weights(0)
    save_file(params, tmp_path / "a.safetensors")
    changed = {k: v.clone() for k, v in params.items()}
    change(changed)
    save_file(changed, tmp_path / "b.safetensors")
    assert _fingerprint(tmp_path / "a.safetensors") != _fingerprint(tmp_path / "b.safetensors")


def test_merge_record_fingerprints_tell_base_and_finetunes_apart(tmp_path):
    base = _weights(0)
    finetunes = [
        {k: v + 0.01 * (t + 1) if v.is_floating_point() else v for k, v in base.items()}
        for t in range(2)
    ]
    save_file(base, tmp_path / "base.safetensors")
    for t, ft in enumerate(finetunes):
        save_file(ft, tmp_path / f"ft{t}.safetensors")
    save_file(finetunes[0], tmp_path / "ft0_copy.safetensors")  # same values, another file
    config = MergeConfig.from_dict(
        {
            "method": "task_arithmetic",
            "base_model": "base.safetensors",
            "models": [{"model": "ft0.safetensors"}, {"model": "ft1.safetensors"}],
        },
        root=tmp_path,
    )
    run_merge(config, tmp_path / "out", progress=False)
    inputs = json.loads((tmp_path / "out" / "gradmerge_merge.json").read_text())["inputs"]
    headers = {v["header_sha256"] for v in inputs.values()}
    values = [
        inputs[n]["fingerprint_sha256"]
        for n in ("base_model", "models[0].model", "models[1].model")
    ]
    assert len(headers) == 1  # the three headers are identical: they could not tell them apart
    assert len(set(values)) == 3
    assert values == [_direct(base), _direct(finetunes[0]), _direct(finetunes[1])]
    assert _fingerprint(tmp_path / "ft0_copy.safetensors") == values[1]
    assert inputs["base_model"]["fingerprint_of"] == fingerprint.CONTENT_HASH_OF
