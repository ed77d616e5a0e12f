"""Tiny checkpoints and curvature files on disk, and the in-memory reference results.

A workspace holds a base MLP θ_LLM, fine-tunes θ_t (the base plus seeded perturbations), their
curvatures estimated with gm.estimate_curvature on seeded data (diag, K-FAC, full), a curvature
at the base (prior / remaining) and a gradient file, all as safetensors. The references load
everything whole and call the gm.* rules on whole state dicts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

import gradmerge as gm

DT = torch.float32


def mlp(seed: int) -> nn.Module:
    """Linear → Tanh → LayerNorm → Linear: K-FAC covers the linear layers, a diagonal the norm."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.LayerNorm(4), nn.Linear(4, 3))


def data(seed: int, n: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)
    return [(x[: n // 2], y[: n // 2]), (x[n // 2 :], y[n // 2 :])]


def finetune(base: nn.Module, seed: int, size: float = 0.3) -> nn.Module:
    model = copy.deepcopy(base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(size * torch.randn(p.shape, generator=g))
    return model


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


@dataclass
class Workspace:
    root: Path
    structure: str
    base: Path
    models: list[Path]
    curvatures: list[Path]
    base_curvature: Path
    gradient: Path
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def load(self, path: Path, dtype: torch.dtype = DT) -> dict[str, torch.Tensor]:
        """The float tensors of a checkpoint file, in ``dtype``."""
        return {k: v.to(dtype) for k, v in load_file(path).items() if v.is_floating_point()}

    def curvature(self, path: Path, dtype: torch.dtype = DT) -> gm.Curvature:
        return gm.load_curvature(path).to(dtype=dtype)

    def merge_dict(self, alpha: float | None = None, **changes: object) -> dict:
        """A gradient-matching merge of every fine-tune with its curvature and δ = 1e-2 (paths
        relative to the workspace, where its YAML files go), with ``changes`` on top."""
        models = [
            {"model": m.name, "curvature": c.name, **({} if alpha is None else {"alpha": alpha})}
            for m, c in zip(self.models, self.curvatures, strict=True)
        ]
        config = {
            "method": "gradient_matching",
            "base_model": self.base.name,
            "models": models,
            "prior": {"delta": 1.0e-2},
        }
        config.update(changes)
        return config

    def yaml(self, name: str, config: dict) -> Path:
        path = self.root / name
        path.write_text(yaml.safe_dump(config))
        return path


def make_workspace(
    root: Path,
    structure: str = "kfac",
    *,
    tasks: int = 2,
    fisher: str = "empirical",
    buffers: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype = DT,
    curvature_dtype: torch.dtype = DT,
) -> Workspace:
    """Write a workspace to ``root`` (checkpoints in ``dtype``, curvatures in ``curvature_dtype``)."""
    root.mkdir(parents=True, exist_ok=True)
    extra = buffers or {}
    base = mlp(0)

    def save(model: nn.Module, name: str) -> Path:
        tensors = {k: v.to(dtype) for k, v in state(model).items()}
        path = root / name
        save_file({**tensors, **extra}, path, metadata={"format": "pt"})
        return path

    models, curvatures = [], []
    for t in range(tasks):
        ft = finetune(base, seed=10 + t)
        models.append(save(ft, f"ft{t}.safetensors"))
        c = _estimate(ft, data(100 + t), structure, fisher, curvature_dtype)
        curvatures.append(c.save(root / f"ft{t}.curvature.safetensors"))
    base_c = _estimate(base, data(200), structure, fisher, curvature_dtype)
    base_c_path = base_c.save(root / "base.curvature.safetensors")
    model = copy.deepcopy(base)
    model.zero_grad()
    x, y = data(300)[0]
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    gradient = root / "gradient.safetensors"
    save_file({k: p.grad.detach().clone() for k, p in model.named_parameters()}, gradient)
    return Workspace(
        root,
        structure,
        save(base, "base.safetensors"),
        models,
        curvatures,
        base_c_path,
        gradient,
        dict(extra),
    )


def _estimate(model, batches, structure, fisher, dtype):
    """The curvature of ``model`` on ``batches``, estimated in ``dtype``."""
    model = copy.deepcopy(model).to(dtype)
    batches = [(x.to(dtype), y) for x, y in batches]
    return gm.estimate_curvature(model, batches, structure=structure, fisher=fisher)


def assert_same(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], **tol: float) -> None:
    """Every tensor of ``ref`` equals the one in ``out`` (exactly unless tolerances are given)."""
    assert set(ref) <= set(out), sorted(set(ref) - set(out))
    for k, v in ref.items():
        torch.testing.assert_close(
            out[k],
            v,
            rtol=tol.get("rtol", 0.0),
            atol=tol.get("atol", 0.0),
            msg=lambda m, k=k: f"{k}: {m}",
        )
