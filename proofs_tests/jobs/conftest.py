"""A tiny GPT-2 (random weights from a config; no download) saved as Hugging Face folders."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import gradmerge as gm


@dataclass
class HFModels:
    root: Path
    base: Path  # a Hugging Face folder (model.safetensors, config.json, generation_config.json)
    models: list[Path]  # models[1] is saved in shards with model.safetensors.index.json
    curvature: Path  # K-FAC (Conv1D layers transposed) + diagonal block, at the base


def _gpt2(seed: int):
    import transformers

    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> HFModels:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    base = _gpt2(0)
    base.save_pretrained(root / "base")
    (root / "base" / "tokenizer_config.json").write_text('{"model_max_length": 8}\n')
    models = []
    for t in range(2):
        ft = copy.deepcopy(base)
        g = torch.Generator().manual_seed(10 + t)
        with torch.no_grad():
            for p in ft.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        ft.save_pretrained(root / f"ft{t}", max_shard_size="5KB" if t == 1 else "1GB")
        models.append(root / f"ft{t}")
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():  # K-FAC leaves wpe to the diagonal block, with a warning
        warnings.simplefilter("ignore", UserWarning)
        c = gm.estimate_curvature(base, [{"input_ids": ids, "labels": ids}], structure="kfac")
    return HFModels(root, root / "base", models, c.save(root / "base.curvature.safetensors"))
