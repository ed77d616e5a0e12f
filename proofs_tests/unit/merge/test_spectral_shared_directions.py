"""TSV-M and Iso-CTS where tasks share singular directions: identical, collinear and nearly
identical task matrices give one answer, whatever the dtype or the SVD's choice of basis.

The whitening polar(X) = P Qᵀ of the concatenated singular vectors X is not unique where X is
rank-deficient — tasks that share directions, U = [A, A] — and the arbitrary P, Q columns of its
zero singular values entered the merge with full weight: two byte-identical fine-tunes gave
results 0.4-0.7 apart between float32 and float64. gm uses the canonical polar factor
W = X (XᵀX)^{+1/2} (the partial isometry on X's range), derived in :func:`gradmerge.merge.spectral._polar`.

References (no SVD, as in test_spectral.py): singular triplets from symmetric eigendecompositions,
and the canonical factor re-derived as X (XᵀX)^{+1/2} from the eigendecomposition of the Gram
matrix with its zero eigenvalues dropped; the closed forms it gives — (1/T)·Σ_t c_t·Δ_k for
tasks c_t·Δ, Δ_k the rank-k truncation of Δ; merging a task with itself gives that task.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import gradmerge as gm
from gradmerge.errors import InputWarning
from gradmerge.merge.spectral import iso_cts_split
from proofs_tests.unit.merge.test_spectral import _top

DT = torch.float64
SHAPES = [(8, 6), (6, 9), (12, 12), (40, 24)]


def _pseudo_inverse_sqrt(gram: torch.Tensor) -> torch.Tensor:
    """(G)^{+1/2}: the eigenvalues of G that are zero up to rounding (≤ 1e-10 of the largest; the
    cases here have them ≤ 1e-30 or ≥ 1e-3) dropped."""
    w, q = torch.linalg.eigh(gram)
    kept = w > 1e-10 * w.max()
    return (q[:, kept] / w[kept].sqrt()) @ q[:, kept].mT


def canonical_polar(x: torch.Tensor) -> torch.Tensor:
    """X (XᵀX)^{+1/2} (tall) or (XXᵀ)^{+1/2} X (wide)."""
    if x.shape[0] >= x.shape[1]:
        return x @ _pseudo_inverse_sqrt(x.mT @ x)
    return _pseudo_inverse_sqrt(x @ x.mT) @ x


def tsv_canonical(deltas: list[torch.Tensor]) -> torch.Tensor:
    k = min(deltas[0].shape) // len(deltas)
    parts = [_top(d, k) for d in deltas]
    u = torch.cat([p[0] for p in parts], 1)
    s = torch.cat([p[1] for p in parts])
    v = torch.cat([p[2] for p in parts], 1)
    return canonical_polar(u) @ torch.diag(s) @ canonical_polar(v).mT


def iso_cts_canonical(deltas: list[torch.Tensor], fraction: float) -> torch.Tensor:
    total = sum(deltas)
    common, n = iso_cts_split(min(total.shape), len(deltas), fraction)
    uc, sc, vc = _top(total, common)
    parts = [_top(d - uc @ uc.mT @ d, n) for d in deltas] if n else []
    u = torch.cat([*(p[0] for p in parts), uc], 1)
    s = torch.cat([*(p[1] for p in parts), sc])
    v = torch.cat([*(p[2] for p in parts), vc], 1)
    return s.mean() * canonical_polar(u) @ canonical_polar(v).mT


def _truncated(delta: torch.Tensor, k: int) -> torch.Tensor:
    u, s, v = _top(delta, k)
    return (u * s) @ v.mT


def _delta(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 0.3 * torch.randn(shape, generator=g, dtype=DT)


def _merge(method, deltas, dtype, **kwargs):
    """``method``'s update of the task matrices ``deltas`` (float64 in), computed in ``dtype``,
    with no InputWarning (the result is unique: nothing to warn about)."""
    base = {"w": torch.zeros(deltas[0].shape, dtype=dtype)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", InputWarning)
        return method(base, [{"w": d.to(dtype)} for d in deltas], **kwargs)["w"].to(DT)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tasks", [2, 3])
def test_identical_tasks_merge_to_that_task_truncated_in_every_dtype(shape, tasks):
    """The issue's case: byte-identical fine-tunes. TSV-M gives Δ_k in float32 and in float64
    (it gave results 0.4-0.7 apart, a spurious rank-k term along arbitrary directions)."""
    delta = _delta(shape, seed=sum(shape))
    k = min(shape) // tasks
    expected = _truncated(delta, k)
    torch.testing.assert_close(tsv_canonical([delta] * tasks), expected, rtol=0, atol=1e-9)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        merged = _merge(gm.tsv_merge, [delta] * tasks, dtype)
        torch.testing.assert_close(merged, expected, rtol=0, atol=tol)


@pytest.mark.parametrize("shape", SHAPES)
def test_collinear_tasks_merge_to_the_mean_of_their_truncations(shape):
    """Tasks c_t·Δ (c = 1, 2, -0.5: powers of two, so the inputs are exact): the whitening of
    [A, A, -A] by X(XᵀX)^{+1/2} gives (1/T)·Σ_t c_t·Δ_k, as derived in the docstring."""
    delta = _delta(shape, seed=7)
    scales = [1.0, 2.0, -0.5]
    k = min(shape) // 3
    expected = sum(scales) / 3 * _truncated(delta, k)
    deltas = [c * delta for c in scales]
    torch.testing.assert_close(tsv_canonical(deltas), expected, rtol=0, atol=1e-9)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        torch.testing.assert_close(_merge(gm.tsv_merge, deltas, dtype), expected, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nearly_identical_tasks_merge_to_the_mean_of_their_truncations(dtype):
    """Two tasks with the same singular vectors and singular values 1% apart (a fine-tune and
    the same run a few steps on, along the same directions): their computed singular vectors
    agree to rounding, so they share directions as identical tasks do, and the merge is the
    mean of the two truncations, ½·U_k (S_1 + S_2)_k V_kᵀ, in either dtype."""
    shape, k = (24, 16), 8
    delta = _delta(shape, seed=3)
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    g = torch.Generator().manual_seed(4)
    near = (u * (s * (1 + 0.01 * torch.rand(s.shape, generator=g, dtype=DT)))) @ vh
    near = near.to(dtype).to(DT)
    delta = delta.to(dtype).to(DT)
    expected = (_truncated(delta, k) + _truncated(near, k)) / 2
    assert (near - delta).abs().max() > 1e-4  # not identical
    torch.testing.assert_close(tsv_canonical([delta, near]), expected, rtol=0, atol=1e-9)
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(_merge(gm.tsv_merge, [delta, near], dtype), expected, rtol=0,
                               atol=tol)  # fmt: skip


def test_a_shared_task_among_others_equals_the_canonical_re_derivation():
    """Three tasks, two of them identical: the shared directions are merged once, the third
    task's whitened against them; float32 and float64 agree, and both equal the
    eigendecomposition re-derivation."""
    a, b = _delta((12, 9), seed=11), _delta((12, 9), seed=12)
    expected = tsv_canonical([a, b, a])
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        torch.testing.assert_close(_merge(gm.tsv_merge, [a, b, a], dtype), expected, rtol=0,
                                   atol=tol)  # fmt: skip


@pytest.mark.parametrize("fraction", [0.5, 0.8])
def test_iso_cts_of_identical_tasks_is_basis_independent(fraction):
    """Iso-CTS whitens the tasks' own directions outside the common subspace the same way:
    identical tasks share them. float32 and float64 agree with the re-derivation."""
    delta = _delta((16, 10), seed=5)
    expected = iso_cts_canonical([delta, delta], fraction)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        merged = _merge(gm.iso_cts, [delta, delta], dtype, common_space_fraction=fraction)
        torch.testing.assert_close(merged, expected, rtol=0, atol=tol)


def test_generic_tasks_are_unchanged_by_the_canonical_factor():
    """Where X has full rank the canonical factor is P Qᵀ: random tasks, square concatenations
    included (T·k = m), equal the plain polar of test_spectral.py's reference."""
    from proofs_tests.unit.merge.test_spectral import tsv_reference

    for shape, tasks in (((12, 12), 3), ((9, 6), 2), ((6, 10), 2)):
        deltas = [_delta(shape, seed=20 + t) for t in range(tasks)]
        torch.testing.assert_close(_merge(gm.tsv_merge, deltas, DT), tsv_reference(deltas),
                                   rtol=1e-9, atol=1e-9)  # fmt: skip


def test_a_tie_at_the_cut_is_warned():
    """σ_k = σ_(k+1): which of the tied directions a task keeps is arbitrary (TSV-M keeps
    k = 2 of Δ = diag(3, 2, 2, 1) with two tasks): warned, naming the matrix."""
    tie = torch.diag(torch.tensor([3.0, 2.0, 2.0, 1.0], dtype=DT))
    other = _delta((4, 4), seed=1)
    base = {"w": torch.zeros(4, 4, dtype=DT)}
    with pytest.warns(InputWarning, match=r"'w' \(4×4\) .*tie at the cut in 1 decomposition"):
        gm.tsv_merge(base, [{"w": tie}, {"w": other}])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tasks_equal_to_rounding_merge_as_identical_ones(dtype):
    """Two tasks differing by rounding-level noise in every entry (a few ulps: a fine-tune
    saved twice through another dtype): their kept subspaces agree to the SVD's accuracy
    (:func:`gradmerge.merge.spectral._accuracy`), so they merge as identical tasks do, to rounding."""
    shape = (24, 16)
    delta = _delta(shape, seed=3).to(dtype).to(DT)
    g = torch.Generator().manual_seed(4)
    eps = torch.finfo(dtype).eps
    near = (delta * (1 + 2 * eps * torch.randn(shape, generator=g, dtype=DT))).to(dtype).to(DT)
    assert not torch.equal(near, delta)
    expected = _truncated(delta, 8)
    merged = _merge(gm.tsv_merge, [delta, near], dtype)
    torch.testing.assert_close(merged, expected, rtol=0, atol=100 * eps)  # measured ≤ 17 ε


def test_the_merge_command_on_byte_identical_fine_tunes_agrees_across_compute_dtypes(tmp_path):
    """The issue's run: `gradmerge merge` with tsv_merge on a fine-tune and its byte copy, at
    compute_dtype float32 and float64 (they differed by 0.43 with no warning). Both give
    θ_LLM + Δ_k on every matrix (Δ_k by eigendecomposition, float64) and the mean elsewhere."""
    import shutil

    from safetensors.torch import load_file

    from gradmerge import cli
    from proofs_tests.workspace import make_workspace

    ws = make_workspace(tmp_path / "ws", "diag", tasks=1, dtype=torch.float64)
    shutil.copy(ws.models[0], ws.root / "copy.safetensors")
    base, ft = ws.load(ws.base, DT), ws.load(ws.models[0], DT)
    outs = {}
    for dtype in ("float32", "float64"):
        config = {"method": "tsv_merge", "base_model": ws.base.name, "compute_dtype": dtype,
                  "models": [{"model": ws.models[0].name}, {"model": "copy.safetensors"}]}  # fmt: skip
        path = ws.yaml(f"tsv-{dtype}.yaml", config)
        with warnings.catch_warnings():
            warnings.simplefilter("error", InputWarning)
            assert cli.main(["merge", str(path), str(tmp_path / dtype), "--no-progress"]) == 0
        outs[dtype] = load_file(tmp_path / dtype / "model.safetensors")
    for key, theta in base.items():
        delta = ft[key] - theta
        expected = theta + (_truncated(delta, min(delta.shape) // 2) if delta.ndim == 2 else delta)
        for dtype, tol in (("float64", 1e-12), ("float32", 1e-6)):
            torch.testing.assert_close(outs[dtype][key].to(DT), expected, rtol=0, atol=tol)
