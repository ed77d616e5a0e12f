"""A bfloat16 job's units go to the C loop as stored (gradmerge.jobs.widened), with the same bytes.

When the base, the models and the output are bfloat16 and the arithmetic float32, the engine
hands each unit's tensors as stored to the method's rule with the widened loop as its kernel; the
written model must equal, bit for bit, the float32 path's (the same job with the widened loop
turned off) and the in-memory rule on the float32 values rounded to bfloat16. What the loop does
not take — a prior formed from a file, a scale, a non-finite input, a result that overflows
bfloat16 — goes to the float32 path, with its errors unchanged, and nothing is written.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import gradmerge as gm
from gradmerge.curvature.diagonal import unchecked
from gradmerge.curvature.io import open_curvature
from gradmerge.jobs import MergeConfig, run_merge, widened
from gradmerge.jobs import job as job_module
from gradmerge.kernels import fused

SHAPES = {"embed.weight": (300, 40), "norm.weight": (40,)}
ALPHAS = (0.7, 0.4, 1.1)
BF16 = torch.bfloat16


def _tensors(g: torch.Generator, positive: bool = False) -> dict[str, torch.Tensor]:
    out = {}
    for k, s in SHAPES.items():
        x = torch.randn(s, generator=g)
        out[k] = (x.abs() if positive else x).to(BF16)
    if not positive:
        out["embed.weight"][:2] = torch.tensor([0.0, -0.0], dtype=BF16)[:, None]  # ±0
    return out


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("widened")
    g = torch.Generator().manual_seed(11)
    save_file(_tensors(g), root / "base.safetensors")
    for t in range(len(ALPHAS)):
        save_file(_tensors(g), root / f"ft{t}.safetensors")
        gm.Diagonal(_tensors(g, positive=True)).save(root / f"c{t}.safetensors")
    gm.Diagonal(_tensors(g, positive=True)).save(root / "prior.safetensors")
    return root


def _config(method: str, **extra) -> dict:
    models = [
        {"model": f"ft{t}.safetensors", "alpha": a}
        | ({"curvature": f"c{t}.safetensors"} if method != "task_arithmetic" else {})
        for t, a in enumerate(ALPHAS)
    ]
    config = {"method": method, "base_model": "base.safetensors", "models": models}
    if method == "gradient_matching":
        config["prior"] = {"delta": 1e-3}
    return config | extra


@pytest.fixture
def calls(monkeypatch):
    """The tensors the widened loop merged (key sizes), counted."""
    seen: list[int] = []
    original = fused.merge_widened

    def spy(base, *args):
        out = original(base, *args)
        seen.append(base.numel() if out is not None else -1)
        return out

    monkeypatch.setattr(fused, "merge_widened", spy)
    return seen


def _run(ws, config, out, monkeypatch, *, widen=True):
    monkeypatch.setattr(job_module, "ROW_BLOCK_BYTES", 64 * 40 * 4)  # 64 rows per block
    if not widen:
        monkeypatch.setattr(widened, "attempt", lambda *args: None)
    run_merge(MergeConfig.from_dict(config, root=ws), out, progress=False)
    return load_file(out / "model.safetensors")


def _in_memory(ws, method):
    load = lambda name: {k: v.float() for k, v in load_file(ws / name).items()}  # noqa: E731
    base, fts = load("base.safetensors"), [load(f"ft{t}.safetensors") for t in range(3)]
    if method == "task_arithmetic":
        return gm.task_arithmetic(base, fts, alphas=list(ALPHAS), kernel=None)
    hs = [open_curvature(ws / f"c{t}.safetensors").load(dtype=torch.float32) for t in range(3)]
    return gm.gradient_matching(base, fts, hs, prior=1e-3, alphas=list(ALPHAS), kernel=None)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == BF16 and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("method", ["task_arithmetic", "gradient_matching"])
def test_bfloat16_units_take_the_widened_loop_with_the_float32_paths_bytes(
    ws, tmp_path, monkeypatch, calls, method
):
    fast = _run(ws, _config(method), tmp_path / "fast", monkeypatch)
    # every block of 64 rows of the embedding (5) and the norm: all by the widened loop
    assert sorted(calls) == sorted([40, *[64 * 40] * 4, 44 * 40])
    monkeypatch.undo()
    slow = _run(ws, _config(method), tmp_path / "slow", monkeypatch, widen=False)
    reference = _in_memory(ws, method)
    for k in SHAPES:
        assert _same_bits(fast[k], slow[k]), k
        assert _same_bits(fast[k], reference[k].to(BF16)), k


@pytest.mark.parametrize(
    ("method", "extra"),
    [
        ("gradient_matching", {"prior": {"delta": 0.5, "curvature": "prior.safetensors"}}),
        ("gradient_matching", {"dtype": "float32"}),  # a float32 output: the float32 path's
        ("fisher_average", {}),  # its θ_LLM = 0 is a tensor the rule makes, not an input
        (  # a scaled H_t is formed in bfloat16 by the rule, not read
            "gradient_matching",
            {"models": [{"model": "ft0.safetensors", "curvature": "c0.safetensors", "scale": 2.0}]},
        ),
    ],
)
def test_what_the_loop_does_not_take_goes_to_the_float32_path(
    ws, tmp_path, monkeypatch, method, extra
):
    tries = []
    original = widened.attempt
    monkeypatch.setattr(widened, "attempt", lambda *a: tries.append(original(*a)) or tries[-1])
    config = _config(method, **extra)
    out = _run(ws, config, tmp_path / "out", monkeypatch)
    assert tries in ([], [None])  # one try per job at most, then the float32 path
    monkeypatch.undo()
    reference = _run(ws, config, tmp_path / "ref", monkeypatch, widen=False)
    for k in SHAPES:
        assert out[k].dtype == reference[k].dtype
        assert torch.equal(out[k], reference[k]) and not out[k].isnan().any(), k


def test_a_result_that_overflows_bfloat16_is_refused_and_nothing_written(ws, tmp_path, monkeypatch):
    big = {k: torch.full(s, 3.0e38).to(BF16) for k, s in SHAPES.items()}
    save_file(big, tmp_path / "big.safetensors")
    target = (torch.finfo(BF16).max + torch.finfo(torch.float32).max) / 2
    alpha = target / float(big["norm.weight"][0])  # θ = θ_LLM + α·(θ_1 − θ_LLM) ≈ target
    base = load_file(ws / "base.safetensors")["norm.weight"].float()
    theta = base + alpha * (big["norm.weight"].float() - base)
    assert bool(torch.isfinite(theta).all()) and bool(torch.isinf(theta.to(BF16)).all())
    config = {
        "method": "task_arithmetic",
        "base_model": "base.safetensors",
        "models": [{"model": str(tmp_path / "big.safetensors"), "alpha": alpha}],
    }
    with pytest.raises(gm.ResultOverflowError, match="overflows the output dtype bfloat16"):
        _run(ws, config, tmp_path / "out", monkeypatch)
    assert not (tmp_path / "out").exists()


def test_a_nan_curvature_is_named_as_on_the_float32_path(ws, tmp_path, monkeypatch, calls):
    bad = {k: v.clone() for k, v in open_curvature(ws / "c1.safetensors").load().values.items()}
    assert bad["embed.weight"].dtype == BF16
    bad["embed.weight"][200, 3] = float("nan")
    unchecked(bad).save(tmp_path / "nan.safetensors")
    config = _config("gradient_matching")
    config["models"][1]["curvature"] = str(tmp_path / "nan.safetensors")
    with pytest.raises(gm.NonFiniteError, match=r"curvatures\[1\]"):
        _run(ws, config, tmp_path / "out", monkeypatch)
    assert -1 in calls  # the widened loop refused the block, the float32 path named the input
    assert not (tmp_path / "out").exists()
