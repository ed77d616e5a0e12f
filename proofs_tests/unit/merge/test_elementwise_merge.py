"""The fused elementwise path of Eq. 6 (diagonal / δ·I curvatures) against the operator algebra.

`gm.gradient_matching` evaluates diagonal merges in one chunked pass (gradmerge.elementwise.matching);
wrapping the same diagonals in `gm.Blocks` forces the generic operator path. The two must agree
bit for bit (same floating-point operations in the same order), give the same errors, and cover
tensors that span several chunks.
"""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradmerge as gm
from gradmerge.elementwise import matching

SHAPES = {"big": (matching.CHUNK + 1234,), "mat": (7, 5), "one": (1,)}


def _params(gen, scale=1.0):
    return {k: scale * torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def _diag(gen):
    return gm.Diagonal({k: torch.rand(s, generator=gen) * 3 for k, s in SHAPES.items()})


def _generic(c):
    return gm.Blocks([c]) if isinstance(c, gm.Diagonal) else c


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    tasks=st.integers(1, 3),
    prior_kind=st.sampled_from(["delta", "diag"]),
    task_kinds=st.lists(st.sampled_from(["delta", "diag", "zero"]), min_size=3, max_size=3),
    alphas=st.lists(st.floats(0.1, 2.0), min_size=3, max_size=3),
)
def test_fused_path_is_bit_identical_to_the_operator_algebra(
    seed, tasks, prior_kind, task_kinds, alphas
):
    gen = torch.Generator().manual_seed(seed)
    base = _params(gen)
    fts = [_params(gen) for _ in range(tasks)]
    prior = 0.37 if prior_kind == "delta" else _diag(gen) + 0.1
    kinds = {"delta": lambda: 1.7, "zero": lambda: 0.0, "diag": lambda: _diag(gen)}
    hs = [kinds[k]() for k in task_kinds[:tasks]]
    fused = gm.gradient_matching(base, fts, hs, prior=prior, alphas=alphas[:tasks])
    generic = gm.gradient_matching(
        base, fts, [_generic(h) for h in hs], prior=_generic(prior), alphas=alphas[:tasks]
    )
    for k in base:
        assert torch.equal(fused[k], generic[k]), k


def test_task_arithmetic_is_bit_identical_to_its_closed_form():
    gen = torch.Generator().manual_seed(0)
    base, fts = _params(gen), [_params(gen) for _ in range(3)]
    merged = gm.task_arithmetic(base, fts, alphas=[0.3, 0.5, 0.9])
    for k in base:  # θ_LLM + Σ_t α_t (θ_t − θ_LLM), the weighted sum first (as mergekit does)
        total = torch.zeros_like(base[k])
        for a, ft in zip([0.3, 0.5, 0.9], fts, strict=True):
            total = total + a * (ft[k] - base[k])
        assert torch.equal(merged[k], base[k] + total)


@pytest.mark.parametrize("where", ["base", "finetuned[1]", "curvatures[0]"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_are_named(where, bad):
    gen = torch.Generator().manual_seed(1)
    base, fts, hs = _params(gen), [_params(gen), _params(gen)], [_diag(gen), _diag(gen)]
    target = {"base": base, "finetuned[1]": fts[1], "curvatures[0]": hs[0].values}[where]
    target["big"][matching.CHUNK + 5] = bad  # in the second chunk
    with pytest.raises(gm.NonFiniteError, match=re.escape(f"{where}['big']")):
        gm.gradient_matching(base, fts, hs, prior=0.1)


def test_negative_curvature_and_singular_systems_give_the_generic_errors():
    gen = torch.Generator().manual_seed(2)
    base, fts = _params(gen), [_params(gen)]
    negative = _diag(gen)
    negative.values["mat"][3, 2] = -1.0
    with pytest.raises(gm.NotPositiveDefiniteError, match=r"curvatures\[0\] is not positive"):
        gm.gradient_matching(base, fts, [negative], prior=2.0)
    zero = gm.Diagonal({k: torch.zeros(s) for k, s in SHAPES.items()})
    with pytest.raises(gm.NotPositiveDefiniteError, match="diagonal system"):
        gm.gradient_matching(base, fts, [zero], prior=0.0)
    with pytest.raises(gm.NotPositiveDefiniteError, match="δ·I"):
        gm.gradient_matching(base, fts, [0.0], prior=0.0)
