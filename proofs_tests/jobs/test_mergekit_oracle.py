"""Oracle: `gradmerge merge` with task_arithmetic equals mergekit's task_arithmetic.

Both read the same small Hugging Face checkpoints (one of them sharded) and merge in float32;
mergekit runs through its Python API (its import costs a few seconds, hence one test).
"""

import pytest
import torch
from safetensors.torch import load_file

from gradmerge.io import open_checkpoint
from gradmerge.jobs import MergeConfig, run_merge


def _tensors(folder):
    with open_checkpoint(folder) as ckpt:
        return {k: ckpt.get(k).clone() for k in ckpt}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside mergekit's imports
def test_task_arithmetic_equals_mergekit(hf_models, tmp_path):
    pytest.importorskip("mergekit", reason="mergekit (test oracle) is not installed")
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions
    from mergekit.merge import run_merge as mergekit_merge

    weights = [0.7, 0.4]
    mk = MergeConfiguration.model_validate(
        {
            "merge_method": "task_arithmetic",
            "base_model": str(hf_models.base),
            "models": [
                {"model": str(m), "parameters": {"weight": w}}
                for m, w in zip(hf_models.models, weights, strict=True)
            ],
            "dtype": "float32",
        }
    )
    options = MergeOptions(quiet=True, write_model_card=False, copy_tokenizer=False)
    mergekit_merge(mk, str(tmp_path / "mergekit"), options)
    oracle = _tensors(tmp_path / "mergekit")

    ours = MergeConfig.from_dict(
        {
            "method": "task_arithmetic",
            "base_model": str(hf_models.base),
            "models": [
                {"model": str(m), "alpha": w}
                for m, w in zip(hf_models.models, weights, strict=True)
            ],
        }
    )
    run_merge(ours, tmp_path / "gradmerge", progress=False)
    got = load_file(tmp_path / "gradmerge" / "model.safetensors")

    assert set(got) == set(oracle)
    for k, v in oracle.items():
        # float32 sums in different orders: a few ulps apart
        torch.testing.assert_close(got[k], v, msg=lambda m, k=k: f"{k}: {m}")
    base = _tensors(hf_models.base)
    moved = max(float((oracle[k] - base[k]).abs().max()) for k in base)
    assert moved > 1e-2  # the merge is not the base
