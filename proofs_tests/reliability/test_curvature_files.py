"""Issue 13, cases 5 and 8: curvature files.

5: a curvature file whose metadata nests its structure 50,000 levels deep raised an uncaught
RecursionError; now a FileFormatError (at any depth above the limit, also one that parses).
8: a curvature records a sample hash of the weights it was estimated at; a merge that pairs it
with other weights warns (or refuses, with ``curvature_weights: refuse``).
"""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import gradmerge as gm
from gradmerge.curvature.io import open_curvature

MAX_SPEC_DEPTH = 32  # gradmerge.curvature.io.MAX_SPEC_DEPTH


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
