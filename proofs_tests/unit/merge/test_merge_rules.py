"""The merge and removal rules against dense numpy formulas and textbook closed forms."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradmerge as gm
from gradmerge import params as P
from proofs_tests.reference import (
    flat,
    like_params,
    merge_dense,
    random_layout,
    random_spd,
    rel_err,
    remove_dense,
)

seeds = st.integers(0, 2**32 - 1)


def _problem(seed, tasks):
    rng = np.random.default_rng(seed)
    like = random_layout(rng)
    n = P.numel(like)
    base = rng.standard_normal(n)
    fts = [base + rng.standard_normal(n) for _ in range(tasks)]
    hs = [random_spd(rng, n, float(10 ** rng.uniform(0, 3))) * rng.uniform(0.1, 10) for _ in fts]
    h0 = random_spd(rng, n, float(10 ** rng.uniform(0, 2)))
    return rng, like, base, fts, hs, h0


@given(seeds, st.integers(1, 4), st.lists(st.floats(0.05, 2.0), min_size=4, max_size=4))
def test_gradient_matching_dense_equals_numpy_formula(seed, tasks, alphas):
    _, like, base, fts, hs, h0 = _problem(seed, tasks)
    alphas = alphas[:tasks]
    got = gm.gradient_matching(
        like_params(like, base),
        [like_params(like, f) for f in fts],
        [gm.Dense(torch.as_tensor(h), like) for h in hs],
        prior=gm.Dense(torch.as_tensor(h0), like),
        alphas=alphas,
    )
    assert list(got) == list(like)
    assert rel_err(flat(got), merge_dense(base, fts, hs, h0, alphas)) < 1e-9


@given(seeds, st.integers(1, 4), st.floats(1e-3, 10.0))
def test_gradient_matching_diagonal_equals_elementwise_formula(seed, tasks, delta):
    rng, like, base, fts, _, _ = _problem(seed, tasks)
    n = P.numel(like)
    ds = [rng.uniform(0.0, 5.0, n) for _ in range(tasks)]
    alphas = list(rng.uniform(0.1, 1.5, tasks))
    got = gm.gradient_matching(
        like_params(like, base),
        [like_params(like, f) for f in fts],
        [gm.Diagonal(like_params(like, d)) for d in ds],
        prior=delta,
        alphas=alphas,
    )
    num = sum(a * (delta + d) * (f - base) for a, d, f in zip(alphas, ds, fts, strict=True))
    den = delta + sum(a * d for a, d in zip(alphas, ds, strict=True))
    assert rel_err(flat(got), base + num / den) < 1e-12


@given(seeds, st.integers(1, 5))
def test_task_arithmetic_is_the_textbook_sum(seed, tasks):
    rng, like, base, fts, _, _ = _problem(seed, tasks)
    alphas = list(rng.uniform(-1, 1, tasks))
    got = gm.task_arithmetic(
        like_params(like, base), [like_params(like, f) for f in fts], alphas=alphas
    )
    ref = base + sum(a * (f - base) for a, f in zip(alphas, fts, strict=True))
    np.testing.assert_allclose(flat(got), ref, rtol=1e-14, atol=1e-14)


def test_task_arithmetic_float32_is_accurate_to_rounding():
    """In float32 the merge is within a few ulps of the same sum computed in float64."""
    torch.manual_seed(0)
    base = {"w": torch.randn(1000)}
    fts = [{"w": base["w"] + torch.randn(1000)} for _ in range(3)]
    alphas = [0.3, 0.5, 0.7]
    got = gm.task_arithmetic(base, fts, alphas=alphas)["w"]
    ref = base["w"].double() + sum(
        a * (ft["w"].double() - base["w"].double()) for a, ft in zip(alphas, fts, strict=True)
    )
    eps = torch.finfo(torch.float32).eps
    assert got.dtype == torch.float32
    assert float((got.double() - ref).abs().max()) <= 8 * eps * float(ref.abs().max())


@given(seeds, st.integers(1, 4))
def test_fisher_average_is_the_textbook_weighted_average(seed, tasks):
    rng, like, _, fts, hs, _ = _problem(seed, tasks)
    alphas = list(rng.uniform(0.1, 2, tasks))
    got = gm.fisher_average(
        [like_params(like, f) for f in fts],
        [gm.Dense(torch.as_tensor(h), like) for h in hs],
        alphas=alphas,
    )
    num = sum(a * h @ f for a, h, f in zip(alphas, hs, fts, strict=True))
    den = sum(a * h for a, h in zip(alphas, hs, strict=True))
    assert rel_err(flat(got), np.linalg.solve(den, num)) < 1e-9


def test_fisher_average_diagonal_closed_form():
    f1, f2 = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 2.0])
    t1, t2 = torch.tensor([0.0, 1.0]), torch.tensor([4.0, 3.0])
    got = gm.fisher_average(
        [{"w": t1}, {"w": t2}], [gm.Diagonal({"w": f1}), gm.Diagonal({"w": f2})]
    )
    torch.testing.assert_close(got["w"], (f1 * t1 + f2 * t2) / (f1 + f2))


@given(seeds, st.floats(0.1, 2.0))
def test_remove_equals_numpy_formula(seed, alpha):
    rng, like, base, fts, hs, h0 = _problem(seed, 2)
    remaining = random_spd(rng, P.numel(like), 100.0)
    got = gm.remove(
        like_params(like, base),
        like_params(like, fts[0]),
        gm.Dense(torch.as_tensor(hs[0]), like),
        remaining=gm.Dense(torch.as_tensor(remaining), like),
        prior=gm.Dense(torch.as_tensor(h0), like),
        alpha=alpha,
    )
    assert rel_err(flat(got), remove_dense(base, fts[0], hs[0], h0, remaining, alpha)) < 1e-9


@given(seeds, st.floats(0.1, 2.0))
def test_influence_remove_equals_numpy_formula(seed, alpha):
    rng, like, base, _, _, _ = _problem(seed, 1)
    n = P.numel(like)
    remaining, g = random_spd(rng, n, 100.0), rng.standard_normal(n)
    got = gm.influence_remove(
        like_params(like, base),
        like_params(like, g),
        remaining=gm.Dense(torch.as_tensor(remaining), like),
        alpha=alpha,
    )
    assert rel_err(flat(got), base + alpha * np.linalg.solve(remaining, g)) < 1e-9


def test_structures_agree_when_they_describe_the_same_matrix():
    """A Diagonal and a Dense with the same diagonal give the same merge."""
    rng, like, base, fts, _, _ = _problem(3, 3)
    n = P.numel(like)
    ds = [rng.uniform(0.5, 2, n) for _ in fts]
    args = (like_params(like, base), [like_params(like, f) for f in fts])
    diag = gm.gradient_matching(*args, [gm.Diagonal(like_params(like, d)) for d in ds], prior=0.1)
    dense = gm.gradient_matching(
        *args, [gm.Dense(torch.as_tensor(np.diag(d)), like) for d in ds], prior=0.1
    )
    np.testing.assert_allclose(flat(diag), flat(dense), rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_is_preserved(dtype):
    base = {"w": torch.zeros(3, dtype=dtype)}
    ft = {"w": torch.ones(3, dtype=dtype)}
    h = gm.Diagonal({"w": torch.full((3,), 2.0, dtype=dtype)})
    for out in (
        gm.gradient_matching(base, [ft], [h], prior=1.0),
        gm.task_arithmetic(base, [ft]),
        gm.remove(base, ft, h, remaining=h + 1.0, prior=1.0),
    ):
        assert out["w"].dtype == dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    _rng, like, base, fts, hs, h0 = _problem(7, 2)
    args = dict(
        base=like_params(like, base),
        finetuned=[like_params(like, f) for f in fts],
        curvatures=[gm.Dense(torch.as_tensor(h), like) for h in hs],
        prior=gm.Dense(torch.as_tensor(h0), like),
    )
    cpu = gm.gradient_matching(**args)
    cuda = {k: v for k, v in args.items()}
    cuda["base"] = {k: v.cuda() for k, v in args["base"].items()}
    cuda["finetuned"] = [{k: v.cuda() for k, v in f.items()} for f in args["finetuned"]]
    cuda["curvatures"] = [c.to("cuda") for c in args["curvatures"]]
    cuda["prior"] = args["prior"].to("cuda")
    got = gm.gradient_matching(**cuda)
    assert all(v.is_cuda for v in got.values())
    np.testing.assert_allclose(flat({k: v.cpu() for k, v in got.items()}), flat(cpu), rtol=1e-10)
