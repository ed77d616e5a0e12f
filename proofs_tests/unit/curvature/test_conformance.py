"""Every curvature type through every algebra operation, against its dense matrix.

Each case (data, below) builds a curvature and, independently of gradmerge's operators, the dense
matrix it stands for over the flattened parameters in the curvature's layout order: diagonals and
dense matrices as given, K-FAC layers as torch.kron(G, A) over the row-major [V | b] matrix
(permuted to the stored weight layout: transposed Conv1D/Embedding weights, Conv2d weight
shapes), Blocks as block-diagonal matrices, lazy Sums as sums, ScaledIdentity as δ·I, a
ShiftedDiagonal (a prior s·C + δ·I left unformed) as s·diag(c) + δ·I, and a
MatrixFree Hessian as torch.func.hessian of the summed loss. Every operation — mv and dense(),
solve and solve_info, C1 + C2 (same structure, and with δ·I, a diagonal and a dense matrix), c · C,
C + δ, to(), the file round trip with metadata where the type is stored as tensors, check_psd, and
the min_eigenvalue bound — is then compared with the dense reference, in the manner of lineax's
operator × solver tests and curvlinops' dense-matrix comparisons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import Tensor

import gradmerge as gm
from gradmerge import params as P
from gradmerge.curvature.diagonal import ShiftedDiagonal
from proofs_tests.reference import spd_tensor

DT = torch.float64


@dataclass(frozen=True)
class Case:
    """A curvature and the dense matrix it stands for."""

    curvature: gm.Curvature
    dense: Tensor  # over P.flatten(like), in the curvature's layout order
    like: dict[str, Tensor]
    stored: bool = True  # stored as tensors: has a file format and a to()
    exact_min_eig: bool = True  # min_eigenvalue is documented exact for this case


def _like_of(layout) -> dict[str, Tensor]:
    return {k: torch.zeros(s, dtype=DT) for k, s in layout}


def _kfac_case(
    rng: np.random.Generator,
    layers: dict[str, dict],
    terms: int = 1,
) -> tuple[gm.KFAC, Tensor, dict[str, Tensor]]:
    """A KFAC over ``layers`` (name → out, in, bias, stored: "linear" | "transposed" | shape)."""
    factors, bias, transposed, shapes = {}, [], [], {}
    index: dict[str, Tensor] = {}  # param name → positions in the layer's row-major [V | b]
    blocks: dict[str, Tensor] = {}
    offset = 0
    for name, spec in layers.items():
        out, n_in, has_bias = spec["out"], spec["in"], spec.get("bias", False)
        cols = n_in + has_bias
        tl = [
            (spd_tensor(rng, cols, rank=spec.get("rank_a")), spd_tensor(rng, out))
            for _ in range(terms)
        ]
        factors[name] = tl if terms > 1 else tl[0]
        blocks[name] = sum(torch.kron(g, a) for a, g in tl)
        idx = torch.arange(out * cols).reshape(out, cols) + offset
        offset += out * cols
        v_idx = idx[:, :n_in]
        stored = spec.get("stored", "linear")
        if stored == "transposed":
            transposed.append(name)
            index[f"{name}.weight"] = v_idx.T.contiguous()
        elif stored == "linear":
            index[f"{name}.weight"] = v_idx
        else:
            shapes[name] = tuple(stored)
            index[f"{name}.weight"] = v_idx.reshape(stored)
        if has_bias:
            bias.append(name)
            index[f"{name}.bias"] = idx[:, n_in]
    K = gm.KFAC(factors, bias=bias, transposed=transposed, weight_shapes=shapes)
    full = torch.block_diag(*blocks.values())
    perm = torch.cat([index[k].reshape(-1) for k, _ in K.layout])
    return K, full[perm][:, perm], _like_of(K.layout)


def _diagonal(rng):
    values = {
        "a": torch.as_tensor(rng.uniform(0.1, 3.0, (2, 3)), dtype=DT),
        "b": torch.as_tensor(rng.uniform(0.1, 3.0, (4,)), dtype=DT),
    }
    return Case(gm.Diagonal(values), torch.diag(P.flatten(values)), _like_of(P.layout_of(values)))


def _shifted_diagonal(rng):
    """A prior s·C + δ·I kept unformed (``Diagonal.shifted``)."""
    case = _diagonal(rng)
    shifted = case.curvature.shifted(0.7, 0.3)
    assert isinstance(shifted, ShiftedDiagonal) and not shifted.formed
    dense = 0.7 * case.dense + 0.3 * torch.eye(case.dense.shape[0], dtype=DT)
    return Case(shifted, dense, case.like)


def _dense(rng):
    like = {"w": torch.zeros(2, 2, dtype=DT), "b": torch.zeros(3, dtype=DT)}
    m = spd_tensor(rng, 7, 50.0)
    return Case(gm.Dense(m, like), m, like)


def _kfac_linear(rng):
    K, m, like = _kfac_case(rng, {"l0": {"out": 3, "in": 2}, "l1": {"out": 2, "in": 3}})
    return Case(K, m, like)


def _kfac_bias(rng):
    K, m, like = _kfac_case(rng, {"l0": {"out": 3, "in": 2, "bias": True}})
    return Case(K, m, like)


def _kfac_transposed(rng):  # GPT-2 Conv1D / nn.Embedding store (in, out)
    K, m, like = _kfac_case(rng, {"c": {"out": 2, "in": 3, "bias": True, "stored": "transposed"}})
    return Case(K, m, like)


def _kfac_conv(rng):  # a Conv2d weight (out, in, kh, kw) viewed as (out, in·kh·kw)
    K, m, like = _kfac_case(
        rng, {"conv": {"out": 2, "in": 4, "bias": True, "stored": (2, 1, 2, 2)}}
    )
    return Case(K, m, like)


def _kfac_two_terms(rng):  # a lazy exact sum of Kronecker terms per layer
    K, m, like = _kfac_case(
        rng, {"l0": {"out": 2, "in": 2, "bias": True}, "l1": {"out": 3, "in": 2}}, terms=2
    )
    return Case(K, m, like)


def _kfac_three_terms_singular_a(rng):  # rank-deficient A factors: PSD, singular without δ
    K, m, like = _kfac_case(rng, {"l0": {"out": 2, "in": 3, "rank_a": 1}}, terms=3)
    return Case(K, m, like)


def _blocks(rng):  # K-FAC, dense and diagonal blocks over disjoint parameters
    K, mk, _ = _kfac_case(rng, {"l0": {"out": 2, "in": 2, "bias": True}})
    dense_like = {"emb": torch.zeros(2, 2, dtype=DT)}
    m = spd_tensor(rng, 4)
    d = {"norm": torch.as_tensor(rng.uniform(0.5, 2.0, (3,)), dtype=DT)}
    C = gm.Blocks([K, gm.Dense(m, dense_like), gm.Diagonal(d)])
    assert [k for k, _ in C.layout] == [k for k, _ in K.layout] + ["emb", "norm"]
    return Case(C, torch.block_diag(mk, m, torch.diag(d["norm"])), _like_of(C.layout))


def _sum(rng):  # K-FAC + diagonal: no structure holds it exactly, so it stays lazy
    K, mk, like = _kfac_case(rng, {"l0": {"out": 2, "in": 3, "bias": True}})
    d = {
        k: torch.as_tensor(rng.uniform(0.1, 1.0, tuple(v.shape)), dtype=DT) for k, v in like.items()
    }
    D = gm.Diagonal(d)
    C = K + D
    assert isinstance(C, gm.Sum)
    md = torch.diag(P.flatten({k: d[k] for k, _ in K.layout}))
    return Case(C, mk + md, like, exact_min_eig=False)


def _identity(rng):
    delta = float(rng.uniform(0.5, 2.0))
    like = {"w": torch.zeros(2, 3, dtype=DT), "b": torch.zeros(2, dtype=DT)}
    # δ·I covers any dict; its dense matrix is over `like`; it has no file (no layout)
    return Case(gm.ScaledIdentity(delta), delta * torch.eye(8, dtype=DT), like, stored=False)


def _matrix_free(rng):
    torch.manual_seed(int(rng.integers(1 << 30)))
    model = torch.nn.Linear(3, 2).double()
    X = torch.randn(5, 3, dtype=DT)
    y = torch.randint(0, 2, (5,))
    C = gm.MatrixFree(model, [(X, y)], kind="hessian")
    names = [k for k, _ in C.layout]
    like = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss(flat: Tensor) -> Tensor:
        p = P.unflatten(flat, C.layout)
        out = torch.func.functional_call(model, p, (X,))
        return torch.nn.functional.cross_entropy(out, y, reduction="sum")

    dense = torch.func.hessian(loss)(P.flatten({k: like[k] for k in names}))
    # the Hessian of a softmax cross-entropy is singular along the logits' common shift: add δ
    return Case(
        C + 0.5,
        dense + 0.5 * torch.eye(len(dense), dtype=DT),
        like,
        stored=False,
        exact_min_eig=False,
    )


CASES: dict[str, Callable[[np.random.Generator], Case]] = {
    "diagonal": _diagonal,
    "shifted-diagonal": _shifted_diagonal,
    "dense": _dense,
    "kfac": _kfac_linear,
    "kfac-bias": _kfac_bias,
    "kfac-transposed": _kfac_transposed,
    "kfac-conv": _kfac_conv,
    "kfac-2terms": _kfac_two_terms,
    "kfac-3terms-singular": _kfac_three_terms_singular_a,
    "blocks": _blocks,
    "sum": _sum,
    "identity": _identity,
    "matrix-free": _matrix_free,
}
SEEDS = (0, 1)


def _case(name: str, seed: int) -> Case:
    return CASES[name](np.random.default_rng(seed))


def _random_params(case: Case, seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g, dtype=DT) for k, v in case.like.items()}


def _dense_of(case: Case, C: gm.Curvature) -> Tensor:
    """The matrix of ``C`` read column by column through ``mv`` (for derived operators)."""
    layout = P.layout_of(case.like) if C.layout is None else C.layout
    n = sum(s.numel() for _, s in layout)
    cols = [P.flatten(C.mv(P.unflatten(torch.eye(n, dtype=DT)[j], layout))) for j in range(n)]
    return torch.stack(cols, dim=1)


def _flat(case: Case, v: dict[str, Tensor]) -> Tensor:
    layout = case.curvature.layout or P.layout_of(case.like)
    return P.flatten({k: v[k] for k, _ in layout})


def _unflat(case: Case, x: Tensor) -> dict[str, Tensor]:
    return P.unflatten(x, case.curvature.layout or P.layout_of(case.like))


def _close(a: Tensor, b: Tensor, rtol: float = 1e-9) -> None:
    scale = max(1.0, float(b.abs().max()))
    assert float((a - b).abs().max()) <= rtol * scale, float((a - b).abs().max())


ALL = pytest.mark.parametrize("name", list(CASES))
SEED = pytest.mark.parametrize("seed", SEEDS)


@ALL
@SEED
def test_mv_and_dense(name, seed):
    case = _case(name, seed)
    v = _random_params(case, seed + 10)
    _close(_flat(case, case.curvature.mv(v)), case.dense @ _flat(case, v), 1e-12)
    layout = case.curvature.layout or P.layout_of(case.like)
    dense = case.curvature.dense(layout)  # δ·I has no dtype of its own: the default one
    _close(dense.double(), case.dense, 1e-12 if dense.dtype == DT else 1e-6)


@ALL
@SEED
def test_solve_and_solve_info(name, seed):
    case = _case(name, seed)
    C = case.curvature + 0.3 if name == "kfac-3terms-singular" else case.curvature
    dense = case.dense + (
        0.3 * torch.eye(len(case.dense), dtype=DT) if C is not case.curvature else 0
    )
    v = _random_params(case, seed + 20)
    want = torch.linalg.solve(dense, _flat(case, v))
    _close(_flat(case, C.solve(v)), want, 1e-7)
    info = C.solve_info(v)
    assert isinstance(info, gm.Solution) and info.success
    _close(_flat(case, info.value), want, 1e-7)
    # the reported residual is the true one (or not measured: nan for direct solves)
    true = float((dense @ _flat(case, info.value) - _flat(case, v)).norm() / _flat(case, v).norm())
    assert info.residual != info.residual or info.residual <= max(1e-8, 10 * true) + 1e-12


@ALL
@SEED
def test_sum_scale_shift(name, seed):
    case = _case(name, seed)
    C, M = case.curvature, case.dense
    other = _case(name, seed + 100)  # same structure and layout, other values
    c = 0.7
    for op, want in [
        (C + other.curvature, M + other.dense),
        (c * C, c * M),
        (C * c, c * M),
        (C + 0.25, M + 0.25 * torch.eye(len(M), dtype=DT)),
        (0.25 + C, M + 0.25 * torch.eye(len(M), dtype=DT)),
    ]:
        assert isinstance(op, gm.Curvature)
        _close(_dense_of(case, op), want, 1e-12)


EXACT_PROMOTION = (gm.ScaledIdentity, gm.Diagonal, gm.Dense)  # ScaledIdentity ⊂ Diagonal ⊂ Dense


@ALL
@SEED
def test_sums_across_structures(name, seed):
    """C + δ·I, C + diagonal, C + dense (either order, scaled): exact, whatever the structures."""
    case = _case(name, seed)
    C, M = case.curvature, case.dense
    layout = C.layout or P.layout_of(case.like)
    rng = np.random.default_rng(seed + 200)
    n = len(M)
    d = torch.as_tensor(rng.uniform(0.1, 2.0, n), dtype=DT)
    m = spd_tensor(rng, n, 20.0)
    like = {k: case.like[k] for k, _ in layout}
    others = [
        (gm.ScaledIdentity(0.4), 0.4 * torch.eye(n, dtype=DT)),
        (gm.Diagonal(P.unflatten(d, layout)), torch.diag(d)),
        (gm.Dense(m, like), m),
    ]
    a, b = -0.5, 1.5
    for other, mo in others:
        _close(_dense_of(case, C + other), M + mo, 1e-12)
        _close(_dense_of(case, other + C), M + mo, 1e-12)
        _close(_dense_of(case, a * C + other * b), a * M + b * mo, 1e-12)
        if isinstance(C, EXACT_PROMOTION):  # exact in the richer of the two structures
            assert (C + other).rank == max(C.rank, other.rank)
            assert isinstance(C + other, EXACT_PROMOTION)


@ALL
def test_to(name):
    case = _case(name, 3)
    C = case.curvature
    if isinstance(C, gm.Sum) and any(isinstance(t, gm.MatrixFree) for t in C.terms):
        with pytest.raises(gm.ArgumentError):  # it computes on its model and data as they are
            C.to(dtype=torch.float32)
        return
    C32 = C.to(dtype=torch.float32)
    v = {k: x.float() for k, x in _random_params(case, 4).items()}
    got = _flat(case, C32.mv(v)).double()
    _close(got, case.dense @ _flat(case, v).double(), 1e-5)
    back = C32.to(dtype=DT)
    if C.layout is not None:  # δ·I holds a Python float: no dtype to remember
        assert C32.coarsest_dtype == torch.float32
        assert back.coarsest_dtype == torch.float32  # float64 again, but only float32's digits
    _close(_dense_of(case, back), case.dense, 1e-6)


@ALL
def test_file_round_trip(name, tmp_path):
    case = _case(name, 5)
    C = case.curvature
    if not case.stored:
        with pytest.raises(gm.ArgumentError):
            C.save(tmp_path / "c.curvature.safetensors")
        assert not (tmp_path / "c.curvature.safetensors").exists()
        return
    C.meta.update({"fisher": "empirical", "num_examples": "128"})
    path = C.save(tmp_path / "c.curvature.safetensors")
    loaded = gm.load_curvature(path, like=case.like)
    # a shifted diagonal is saved as its (formed) values: it loads as the Diagonal it equals
    stored_as = gm.Diagonal if isinstance(C, ShiftedDiagonal) else type(C)
    assert type(loaded) is stored_as and loaded.layout == C.layout
    assert loaded.meta == {"fisher": "empirical", "num_examples": "128"}
    _close(_dense_of(case, loaded), case.dense, 0.0)


@ALL
@SEED
def test_check_psd(name, seed):
    case = _case(name, seed)
    case.curvature.check_psd(name="C")  # PSD: accepted
    if isinstance(case.curvature, gm.ScaledIdentity):
        negative = case.curvature.scaled(-1.0)
    else:
        negative = case.curvature + (-2.0 * float(torch.linalg.eigvalsh(case.dense)[-1]))
    with pytest.raises(gm.NotPositiveDefiniteError):
        negative.check_psd(name="C")


@ALL
@SEED
def test_min_eigenvalue_bound(name, seed):
    """min_eigenvalue ≤ λ_min(dense) for every structure, equal where documented exact."""
    case = _case(name, seed)
    C = case.curvature
    lam = float(torch.linalg.eigvalsh(case.dense)[0])
    low = C.min_eigenvalue()
    scale = float(torch.linalg.eigvalsh(case.dense).abs().max())
    assert low <= lam + 1e-10 * scale
    assert C.min_eigenvalue_exact is case.exact_min_eig
    if C.min_eigenvalue_exact:
        assert abs(low - lam) <= 1e-10 * scale


def test_min_eigenvalue_of_large_multi_term_kfac_is_a_bound():
    """Above EXACT_EIG_MAX_SIZE parameters, several Kronecker terms give Weyl's lower bound."""
    from gradmerge.curvature.kfac import EXACT_EIG_MAX_SIZE

    rng = np.random.default_rng(7)
    side = int(EXACT_EIG_MAX_SIZE**0.5) + 1  # side² > the limit
    terms = [(spd_tensor(rng, side), spd_tensor(rng, side)) for _ in range(2)]
    K = gm.KFAC({"l": terms})
    assert not K.min_eigenvalue_exact
    lam = float(torch.linalg.eigvalsh(sum(torch.kron(g, a) for a, g in terms))[0])
    weyl = sum(float(torch.linalg.eigvalsh(a)[0] * torch.linalg.eigvalsh(g)[0]) for a, g in terms)
    assert K.min_eigenvalue() == pytest.approx(weyl, rel=1e-10)
    assert K.min_eigenvalue() <= lam
