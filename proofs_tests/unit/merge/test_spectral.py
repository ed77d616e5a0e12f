"""gm.tsv_merge, gm.iso_c and gm.iso_cts: re-derived from the papers' equations, their properties,
and bad input.

The references here use no singular value decomposition: singular triplets come from symmetric
eigendecompositions (Δ Δᵀ = U S² Uᵀ, v = Δᵀu/σ), and the whitening polar(X) = P Qᵀ of
X = P Σ Qᵀ is X (XᵀX)^{-1/2} (tall) or (XXᵀ)^{-1/2} X (wide), so they are independent of the code
under test. fusion-bench's own implementations are the oracle of
proofs_tests/oracles/test_fusion_bench.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradmerge as gm
from gradmerge.merge.spectral import iso_cts_split

DT = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-9}
METHODS = {"tsv_merge": gm.tsv_merge, "iso_c": gm.iso_c, "iso_cts": gm.iso_cts}


def _models(seed: int, tasks: int, shapes: dict[str, tuple[int, ...]], dtype=DT):
    g = torch.Generator().manual_seed(seed)
    base = {k: torch.randn(s, generator=g, dtype=DT).to(dtype) for k, s in shapes.items()}
    fts = [
        {
            k: (v.to(DT) + torch.randn(v.shape, generator=g, dtype=DT)).to(dtype)
            for k, v in base.items()
        }
        for _ in range(tasks)
    ]
    return base, fts


# ----- independent references (eigendecompositions only) -------------------------------------
def _inverse_sqrt(gram: torch.Tensor) -> torch.Tensor:
    w, q = torch.linalg.eigh(gram)
    return (q / w.sqrt()) @ q.mT


def _polar(x: torch.Tensor) -> torch.Tensor:
    return x @ _inverse_sqrt(x.mT @ x) if x.shape[0] >= x.shape[1] else _inverse_sqrt(x @ x.mT) @ x


def _top(delta: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-k singular triplets of Δ: u from Δ Δᵀ's eigenvectors, σ = √λ, v = Δᵀu / σ."""
    w, q = torch.linalg.eigh(delta @ delta.mT)
    order = torch.argsort(w, descending=True)[:k]
    u, s = q[:, order], w[order].clamp_min(0).sqrt()
    return u, s, (delta.mT @ u) / s


def _nuclear(x: torch.Tensor) -> torch.Tensor:
    small = x.mT @ x if x.shape[0] >= x.shape[1] else x @ x.mT
    return torch.linalg.eigvalsh(small).clamp_min(0).sqrt().sum()


def tsv_reference(deltas: list[torch.Tensor]) -> torch.Tensor:
    """Gargiulo et al.: U = [U_t,k], S = diag(S_t,k), V = [V_t,k]; polar(U) S polar(V)ᵀ."""
    k = min(deltas[0].shape) // len(deltas)
    parts = [_top(d, k) for d in deltas]
    u = torch.cat([p[0] for p in parts], 1)
    s = torch.cat([p[1] for p in parts])
    v = torch.cat([p[2] for p in parts], 1)
    return _polar(u) @ torch.diag(s) @ _polar(v).mT


def iso_c_reference(deltas: list[torch.Tensor]) -> torch.Tensor:
    """Marczak et al.: σ̄ U Vᵀ of Σ Δ_t = polar(Σ Δ_t) · ‖Σ Δ_t‖_* / r."""
    total = sum(deltas)
    return _polar(total) * _nuclear(total) / min(total.shape)


def iso_cts_reference(deltas: list[torch.Tensor], fraction: float) -> torch.Tensor:
    """Marczak et al.: the sum's top c directions and each task's top n outside them, whitened,
    at the mean of their singular values."""
    total = sum(deltas)
    common, n = iso_cts_split(min(total.shape), len(deltas), fraction)
    uc, sc, vc = _top(total, common)
    parts = [_top(d - uc @ uc.mT @ d, n) for d in deltas] if n else []
    u = torch.cat([*(p[0] for p in parts), uc], 1)
    s = torch.cat([*(p[1] for p in parts), sc])
    v = torch.cat([*(p[2] for p in parts), vc], 1)
    return s.mean() * _polar(u) @ _polar(v).mT


SHAPES = [(7, 5), (5, 9), (6, 6), (12, 10)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tasks", [1, 2, 3])
def test_matrices_equal_the_papers_equations(shape, tasks):
    base, fts = _models(sum(shape) + tasks, tasks, {"w": shape})
    deltas = [ft["w"] - base["w"] for ft in fts]
    for method, reference in (
        (gm.tsv_merge, tsv_reference),
        (gm.iso_c, iso_c_reference),
        (gm.iso_cts, lambda d: iso_cts_reference(d, 0.8)),
        (
            lambda b, f: gm.iso_cts(b, f, common_space_fraction=0.5),
            lambda d: iso_cts_reference(d, 0.5),
        ),
    ):
        torch.testing.assert_close(method(base, fts)["w"] - base["w"], reference(deltas), **TOL)


@pytest.mark.parametrize("method", METHODS)
def test_other_tensors_and_average_get_the_mean_of_the_task_vectors(method):
    shapes = {"w": (4, 3), "emb": (6, 3), "b": (3,), "conv": (2, 2, 3, 3), "s": ()}
    base, fts = _models(1, 3, shapes)
    merged = METHODS[method](base, fts, alphas=[0.5, 2.0, 1.0], average=["emb"])
    for k in ("emb", "b", "conv", "s"):
        mean = (0.5 * fts[0][k] + 2.0 * fts[1][k] + fts[2][k]) / 3 - (3.5 / 3 - 1) * base[k]
        torch.testing.assert_close(merged[k], mean, **TOL)
    assert not torch.allclose(merged["w"], base["w"] + sum(ft["w"] - base["w"] for ft in fts) / 3)


def test_tsv_merge_of_one_task_is_that_task():
    base, fts = _models(2, 1, {"w": (6, 4), "b": (4,)})
    for alpha in (1.0, 0.3, -2.0):
        expected = {k: base[k] + alpha * (fts[0][k] - base[k]) for k in base}
        merged = gm.tsv_merge(base, fts, alphas=alpha)
        for k in base:
            torch.testing.assert_close(merged[k], expected[k], **TOL)


def test_tsv_merge_of_orthogonal_tasks_is_the_sum_of_their_truncations():
    """Tasks whose top-k singular subspaces are mutually orthogonal (left and right) need no
    whitening: TSV-M is the sum of each task matrix truncated to its rank-k part."""
    g = torch.Generator().manual_seed(3)
    m, n, tasks = 9, 7, 3
    k = min(m, n) // tasks  # 2
    q1 = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=DT))[0]
    q2 = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT))[0]
    base = {"w": torch.randn(m, n, generator=g, dtype=DT)}
    fts, truncated = [], []
    for t in range(tasks):
        top = list(range(t * k, (t + 1) * k))
        rest = [i for i in range(min(m, n)) if i not in top][:3]  # weaker, in others' directions
        strong = q1[:, top] @ torch.diag(torch.tensor([5.0 + t, 4.0], dtype=DT)) @ q2[:, top].mT
        weak = q1[:, rest] @ torch.diag(torch.tensor([1.0, 0.5, 0.25], dtype=DT)) @ q2[:, rest].mT
        fts.append({"w": base["w"] + strong + weak})
        truncated.append(strong)
    torch.testing.assert_close(gm.tsv_merge(base, fts)["w"], base["w"] + sum(truncated), **TOL)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 9),
    cols=st.integers(1, 9),
    tasks=st.integers(1, 4),
    fraction=st.sampled_from([0.5, 0.8, 1.0]),
)
def test_iso_merges_have_a_flat_spectrum(seed, rows, cols, tasks, fraction):
    """Iso-C: every singular value of the update is the mean of those of Σ Δ_t (so the nuclear
    norm is kept); Iso-CTS: all equal too, and with fraction 1 it is Iso-C."""
    base, fts = _models(seed, tasks, {"w": (rows, cols)})
    total = sum(ft["w"] - base["w"] for ft in fts)
    iso = gm.iso_c(base, fts)["w"] - base["w"]
    s = torch.linalg.svdvals(iso)
    torch.testing.assert_close(
        s, torch.full_like(s, float(_nuclear(total)) / min(rows, cols)), **TOL
    )
    cts = gm.iso_cts(base, fts, common_space_fraction=fraction)["w"] - base["w"]
    s = torch.linalg.svdvals(cts)
    torch.testing.assert_close(s, torch.full_like(s, float(s.mean())), **TOL)
    if fraction == 1.0:
        torch.testing.assert_close(cts, iso, **TOL)


@pytest.mark.parametrize("method", METHODS)
def test_alpha_scales_the_merged_update(method):
    """Each method is homogeneous of degree one: one α scales the update (the papers'
    θ_LLM + α·M), and per-task α_t equal merging the fine-tunes θ_LLM + α_t τ_t at α = 1."""
    merge = METHODS[method]
    base, fts = _models(4, 3, {"w": (8, 6), "b": (6,)})
    update = {k: v - base[k] for k, v in merge(base, fts).items()}
    for alpha in (0.25, 2.0, -1.5):
        merged = merge(base, fts, alphas=alpha)
        for k in base:
            torch.testing.assert_close(merged[k], base[k] + alpha * update[k], **TOL)
    alphas = [0.5, 1.5, -0.25]
    scaled = [
        {k: base[k] + a * (ft[k] - base[k]) for k in base}
        for a, ft in zip(alphas, fts, strict=True)
    ]
    per_task, expected = merge(base, fts, alphas=alphas), merge(base, scaled)
    for k in base:
        torch.testing.assert_close(per_task[k], expected[k], **TOL)


@pytest.mark.parametrize("method", METHODS)
def test_the_order_of_the_tasks_does_not_matter(method):
    base, fts = _models(5, 3, {"w": (10, 8), "b": (8,)})
    a, b = METHODS[method](base, fts), METHODS[method](base, fts[::-1])
    for k in base:
        torch.testing.assert_close(a[k], b[k], **TOL)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_keys_shapes_and_dtypes_are_kept(method, dtype):
    """Half-precision inputs are merged in float32 and returned in their dtype."""
    shapes = {"w": (5, 4), "b": (4,), "s": ()}
    base, fts = _models(6, 2, shapes, dtype=dtype)
    merged = METHODS[method](base, fts)
    assert list(merged) == list(base)
    assert all(merged[k].shape == base[k].shape and merged[k].dtype == dtype for k in base)
    if dtype in (torch.float16, torch.bfloat16):
        wide = METHODS[method](
            {k: v.float() for k, v in base.items()},
            [{k: v.float() for k, v in ft.items()} for ft in fts],
        )
        for k in base:
            torch.testing.assert_close(merged[k], wide[k].to(dtype), rtol=0, atol=0)


# ----- where the decomposition is not unique: warned ------------------------------------------
def test_tsv_merge_of_a_matrix_with_fewer_directions_than_tasks_is_zero_and_warned():
    base, fts = _models(7, 3, {"head": (2, 6), "b": (2,)})
    with pytest.warns(gm.InputWarning, match=r"'head' has rank at most 2 < 3 tasks.*`average`"):
        merged = gm.tsv_merge(base, fts)
    torch.testing.assert_close(merged["head"], base["head"], rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        averaged = gm.tsv_merge(base, fts, average=["head"])
    mean = sum(ft["head"] - base["head"] for ft in fts) / 3
    torch.testing.assert_close(averaged["head"], base["head"] + mean, **TOL)


@pytest.mark.parametrize("method", METHODS)
def test_zero_singular_values_kept_are_warned_but_an_unchanged_matrix_is_not(method):
    base = {"w": torch.zeros(4, 4, dtype=DT)}
    rank_one = {"w": torch.outer(torch.arange(1.0, 5.0, dtype=DT), torch.ones(4, dtype=DT))}
    with pytest.warns(
        gm.InputWarning, match=r"'w' \(4×4\) keeps \d singular direction\(s\) with singular value 0"
    ):
        METHODS[method](base, [rank_one, dict(base)])  # the second task left w unchanged
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = METHODS[method](base, [dict(base), dict(base)])  # a layer no task trained
    torch.testing.assert_close(merged["w"], base["w"], rtol=0, atol=0)


def test_the_zero_floor_tells_stored_low_rank_matrices_from_full_rank_ones():
    """√max(m, n)·ε·σ_max: above what rounding leaves of a float32 low-rank product (a LoRA
    update), below the least singular value of random full-rank float32 matrices."""
    g = torch.Generator().manual_seed(9)
    for m, n, k in [(384, 384, 8), (1536, 384, 4), (64, 32, 1)]:
        update = (0.01 * torch.randn(m, k, generator=g)) @ torch.randn(k, n, generator=g)
        base = {"w": torch.randn(m, n, generator=g)}
        with pytest.warns(gm.InputWarning, match=r"keeps \d+ singular direction"):
            gm.iso_c(base, [{"w": base["w"] + update}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(20):
            gm.iso_c({"w": torch.zeros(384, 384)}, [{"w": torch.randn(384, 384, generator=g)}])


# ----- Iso-CTS's split --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rank", "tasks", "fraction", "expected"),
    [
        (768, 8, 0.8, (616, 19)),  # ViT-B: c = ⌊614.4⌋ = 614 → 616 so that 152 = 8·19
        (10, 3, 0.8, (7, 1)),
        (6, 2, 0.8, (4, 1)),
        (5, 3, 0.8, (5, 0)),  # round(1/3) = 0: all common, Iso-C
        (3, 2, 0.8, (3, 0)),  # round(1/2) = 0 (Python rounds halves to even)
        (5, 2, 0.4, (1, 2)),  # round(3/2) = 2
        (1, 1, 0.5, (0, 1)),
        (4, 2, 1.0, (4, 0)),
        (4, 2, 0.0, (0, 2)),
    ],
)
def test_iso_cts_split(rank, tasks, fraction, expected):
    common, n = iso_cts_split(rank, tasks, fraction)
    assert (common, n) == expected and common + tasks * n == rank


def test_a_split_with_more_task_directions_than_the_rank_is_refused():
    with pytest.raises(
        gm.ArgumentError, match=r"rounds to 4 > 3: use a larger common_space_fraction"
    ):
        iso_cts_split(3, 2, 0.0)
    base, fts = _models(8, 2, {"w": (3, 5)})
    with pytest.raises(gm.ArgumentError, match="larger common_space_fraction"):
        gm.iso_cts(base, fts, common_space_fraction=0.0)


# ----- bad input: typed errors ------------------------------------------------------------------
BASE = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
FT = {"w": torch.ones(3, 2), "b": torch.ones(2)}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("finetuned", "kwargs", "error", "match"),
    [
        ([], {}, gm.ArgumentError, "at least one fine-tuned model"),
        (
            [{"w": torch.ones(2, 3), "b": torch.ones(2)}],
            {},
            gm.StructureError,
            r"finetuned\[0\]\['w'\] has shape \(2, 3\)",
        ),
        ([{"w": torch.ones(3, 2)}], {}, gm.StructureError, r"missing 1 key.*'b'"),
        (
            [{"w": torch.full((3, 2), float("nan")), "b": torch.ones(2)}],
            {},
            gm.NonFiniteError,
            r"finetuned\[0\]\['w'\]",
        ),
        ([{k: v.double() for k, v in FT.items()}], {}, gm.DTypeError, "float64"),
        ([FT], {"alphas": [1.0, 2.0]}, gm.ArgumentError, "got 2 alphas for 1 fine-tuned"),
        ([FT], {"alphas": "0.5"}, gm.ArgumentError, "must be numbers"),
        (
            [FT],
            {"average": ["nope"]},
            gm.StructureError,
            "average names 'nope', which base does not have",
        ),
        ([FT], {"average": "w"}, gm.ArgumentError, "average must be a collection of names"),
        (
            [{"w": torch.full((3, 2), 3e38), "b": torch.ones(2)}],
            {"alphas": 10.0},
            gm.ResultOverflowError,
            r"'w' overflowed float32.*smaller α",
        ),
    ],
)
def test_bad_input_gives_typed_errors(method, finetuned, kwargs, error, match):
    with pytest.raises(error, match=match):
        METHODS[method](BASE, finetuned, **kwargs)


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan"), "0.8", True])
def test_common_space_fraction_outside_0_1_is_refused(fraction):
    with pytest.raises(
        gm.ArgumentError, match=r"common_space_fraction must be a number in \[0, 1\]"
    ):
        gm.iso_cts(BASE, [FT], common_space_fraction=fraction)
