"""Tiny seeded models and data for the distributed tests, shared by the test process and the ranks.

Every function takes no arguments (so that ``gradmerge curvature`` can load them as entry points
``cases.py:lm_model``) and returns the same weights/batches in every process.
"""

from __future__ import annotations

import os

import torch
from torch import nn

DT = torch.float64
VOCAB, CLASSES, SEQ = 11, 3, 3


class TinyLM(nn.Module):
    """Token embedding → Linear → tanh → LayerNorm → Linear, applied at every position.

    K-FAC covers the embedding (a diagonal A), both linear layers (weight sharing over positions);
    LayerNorm is left to the diagonal block, so K-FAC estimates are ``Blocks``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 4)
        self.hidden = nn.Linear(4, 5)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.hidden(self.tok(ids)))))


class PositionLM(TinyLM):
    """TinyLM plus a position embedding called with batch dimension 1 (``pos(arange)[None]``):
    K-FAC covers it only when every batch holds one example."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(SEQ, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1])[None])
        return self.head(self.norm(torch.tanh(self.hidden(x))))


def _init(model: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    for p in model.parameters():
        nn.init.normal_(p, std=0.7)
    return model.to(DT).eval()


def lm_model() -> nn.Module:
    return _init(TinyLM(), 0)


def position_model() -> nn.Module:
    return _init(PositionLM(), 1)


def lm_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three batches of 4, 3 and 5 sequences (12 examples), some targets ignored (-100)."""
    g = torch.Generator().manual_seed(2)
    out = []
    for size in (4, 3, 5):
        ids = torch.randint(0, VOCAB, (size, SEQ), generator=g)
        targets = torch.randint(0, CLASSES, (size, SEQ), generator=g)
        targets[torch.rand(size, SEQ, generator=g) < 0.3] = -100
        out.append((ids, targets))
    return out


def mlp_model() -> nn.Module:
    return _init(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), 3)


def mlp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four regression batches of 3, 2, 4 and 3 rows (12 examples)."""
    g = torch.Generator().manual_seed(4)
    return [
        (torch.randn(n, 3, generator=g, dtype=DT), torch.randn(n, 2, generator=g, dtype=DT))
        for n in (3, 2, 4, 3)
    ]


def mlp_batches_nan_last() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``mlp_batches`` with a NaN input in the last batch (on the last rank once sharded)."""
    data = mlp_batches()
    data[-1][0][0, 0] = float("nan")
    return data


# (name, model, data, options): every structure × fisher type on the token model (weight sharing,
# masks, an embedding, an uncovered LayerNorm), and on the regression MLP (mse).
CASES: list[tuple[str, str, str, dict]] = [
    *(
        (f"lm-{s}-{f}", "lm_model", "lm_batches", {"structure": s, "fisher": f})
        for s in ("diag", "kfac", "full")
        for f in ("empirical", "mc", "ggn")
    ),
    (
        "lm-kfac-reduce-ggn",
        "lm_model",
        "lm_batches",
        {"structure": "kfac", "fisher": "ggn", "kfac_approx": "reduce"},
    ),
    (
        "lm-kfac-reduce-mc",
        "lm_model",
        "lm_batches",
        {"structure": "kfac", "fisher": "mc", "kfac_approx": "reduce", "mc_samples": 2, "seed": 5},
    ),
    ("lm-full-hessian", "lm_model", "lm_batches", {"structure": "full", "fisher": "hessian"}),
    *(
        (f"mlp-{s}-{f}", "mlp_model", "mlp_batches", {"structure": s, "fisher": f, "loss": "mse"})
        for s in ("diag", "kfac", "full")
        for f in ("empirical", "mc", "ggn")
    ),
]


def build(name: str):
    """The object a case names (``lm_model``, ``lm_batches``, ...)."""
    return globals()[name]()


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


# Distributed merges and removals over a workspace of proofs_tests.workspace (a base
# MLP, two fine-tunes, their K-FAC curvatures, a curvature at the base): name → (command,
# configuration relative to the workspace). Shards of at most 48 bytes: several per rank.
MERGES: dict[str, tuple[str, dict]] = {
    "merge_gm_kfac": (
        "merge",
        {
            "method": "gradient_matching",
            "base_model": "base.safetensors",
            "models": [
                {"model": f"ft{t}.safetensors", "curvature": f"ft{t}.curvature.safetensors"}
                for t in range(2)
            ],
            "prior": {"delta": 1e-2, "curvature": "base.curvature.safetensors", "scale": 0.5},
            "max_shard_size": 48,
            "device": "cpu",
        },
    ),
    "merge_ta": (
        "merge",
        {
            "method": "task_arithmetic",
            "base_model": "base.safetensors",
            "models": [{"model": f"ft{t}.safetensors", "alpha": 0.5} for t in range(2)],
            "max_shard_size": 48,
            "device": "cpu",
        },
    ),
    "remove_eq13": (
        "remove",
        {
            "method": "remove",
            "base_model": "base.safetensors",
            "model": "ft0.safetensors",
            "curvature": "ft0.curvature.safetensors",
            "prior": {"delta": 1e-2},
            "remaining": {"delta": 1e-1, "curvature": "base.curvature.safetensors"},
            "alpha": 0.5,
            "max_shard_size": 48,
            "device": "cpu",
        },
    ),
}
"""``merge_fail`` (not listed): ``merge_gm_kfac`` on a copy of ft1 with a NaN in the last layer,
whose unit belongs to the last rank. ``remove_refused`` (not listed): ``remove_eq13`` with a
``max_relative_step`` below its step."""


def merge_config(root: str, name: str):
    """The MergeConfig/RemoveConfig of case ``name`` over the workspace at ``root``."""
    from pathlib import Path

    from gradmerge.jobs import MergeConfig, RemoveConfig

    if name == "remove_refused":  # a step limit below the step: refused on every rank
        command, config = MERGES["remove_eq13"]
        config = {**config, "max_relative_step": 1e-3}
    elif name == "merge_fail":
        command, config = MERGES["merge_gm_kfac"]
        models = [dict(m) for m in config["models"]]
        models[1]["model"] = "ft1-nan.safetensors"
        config = {**config, "models": models}
    else:
        command, config = MERGES[name]
    cls = MergeConfig if command == "merge" else RemoveConfig
    return command, cls.from_dict(config, root=Path(root))


def write_nan_model(root: str) -> None:
    """ft1-nan.safetensors: ft1 with a NaN in its last layer's weight ("3.weight")."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    tensors = load_file(Path(root) / "ft1.safetensors")
    tensors["3.weight"][0, 0] = float("nan")
    save_file(tensors, Path(root) / "ft1-nan.safetensors", metadata={"format": "pt"})
