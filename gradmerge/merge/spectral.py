r"""Data-free merges in each weight matrix's singular basis: TSV-M, Iso-C and Iso-CTS.

Task arithmetic adds the task vectors τ_t = θ_t − θ_LLM. For every weight MATRIX (a 2-D tensor:
linear layers, attention projections, embeddings) the three methods here merge the α-weighted
task matrices Δ_t = α_t τ_t through singular value decompositions instead, one matrix at a time
(r = min(m, n) for an m × n matrix, T tasks; polar(X) = P Qᵀ for X = P Σ Qᵀ, the matrix with
orthonormal columns or rows nearest to X):

- **TSV-M** (Gargiulo et al., CVPR 2025): each Δ_t keeps its top k = ⌊r/T⌋ singular triplets
  Δ_t ≈ U_t S_t V_tᵀ; they are concatenated, U = [U_1 … U_T], S = diag(S_1, …, S_T),
  V = [V_1 … V_T], and the two bases are decorrelated by whitening:
  M = polar(U) S polar(V)ᵀ.
- **Iso-C** (Marczak et al., ICML 2025): the spectrum of the task-arithmetic sum
  Σ_t Δ_t = U S Vᵀ is flattened to the mean of its r singular values: M = σ̄ U Vᵀ.
- **Iso-CTS** (same paper): the top c singular directions of Σ_t Δ_t (the common subspace,
  c ≈ 0.8 r, :func:`iso_cts_split`) are kept and the other r − c are replaced by each task's top
  n = (r − c)/T directions of Δ_t with the common subspace projected out,
  (I − U_c U_cᵀ) Δ_t; the concatenated bases are whitened as in TSV-M and the spectrum flattened
  as in Iso-C: M = σ̄ polar(U) polar(V)ᵀ, σ̄ the mean of the r kept singular values.

The merge is θ = θ_LLM + M. Every other tensor (biases, LayerNorms, convolution kernels, the
2-D tensors named in ``average``) gets the mean of the task vectors, (1/T) Σ_t α_t τ_t, as the
reference implementations (the authors' code and fusion-bench) merge "non-matrix" parameters.
Each method couples only the tensors of one matrix, so ``gradmerge merge`` streams it tensor by
tensor.

**α.** Each map above is homogeneous of degree one (M(cΔ_1, …, cΔ_T) = c·M(Δ_1, …, Δ_T) for
every real c), so one α for all tasks gives the papers' θ_LLM + α·M(τ_1, …, τ_T), and per-task α_t
weigh the task vectors before the decompositions (fusion-bench's TSV-M with a list of α). The
default α = 1 is fusion-bench's (``alpha: 1`` for TSV-M, ``scaling_factor: 1.0`` for Iso-C and
Iso-CTS); the authors' code (AntoAndGar/task_singular_vectors, danielm1405/iso-merging) picks α
on validation labels from {0.1, 0.2, …, 3.0}; ``gradmerge tune`` chooses it on the tasks' training
data instead.

**Where the SVD is not unique.** A kept singular value that is zero (a task matrix of rank below
the directions kept — a LoRA update, a layer one fine-tune left unchanged — or, for Iso-C, a
rank-deficient sum) has arbitrary singular vectors, which the whitening mixes into the other
directions (TSV-M) or the flat spectrum gives weight σ̄ (Iso-C, Iso-CTS): that matrix's merge
then depends on the SVD routine. The methods are computed as the papers' code computes them,
and such a matrix is named in an :class:`~gradmerge.errors.InputWarning`; list it in ``average``
to merge it by the mean instead. So is a matrix whose kept singular values tie at the cut
(σ_k = σ_(k+1): which tied directions are kept is arbitrary). Tasks that SHARE directions
(identical or collinear task matrices, or equal to rounding) make the concatenated bases
rank-deficient, where polar(U) = P Qᵀ is not unique either (its P, Q columns for the zero
singular values are arbitrary, and P Qᵀ gives them full weight): there the whitening is the
canonical polar factor U(UᵀU)^{+1/2}, the partial isometry on U's range, which equals P Qᵀ
whenever U has full rank and makes T tasks c_t·Δ merge to (1/T)·Σ_t c_t·Δ_k (a task merged with
itself is that task, truncated), independent of the basis and the dtype (:func:`_polar`,
:func:`_accuracy`: "rank-deficient" is judged against how accurately the SVD knows the kept
subspaces). Tasks whose shared directions differ by more than that are merged by P Qᵀ, which is
unique there but not continuous as they meet.

References:
    A. A. Gargiulo, D. Crisostomi, M. S. Bucarelli, S. Scardapane, F. Silvestri, E. Rodolà,
    "Task Singular Vectors: Reducing Task Interference in Model Merging", CVPR 2025.
    D. Marczak, S. Magistri, S. Cygert, B. Twardowski, A. D. Bagdanov, J. van de Weijer, "No Task
    Left Behind: Isotropic Model Merging with Common and Task-Specific Subspaces", ICML 2025.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Collection, Sequence
from functools import partial

import torch
from torch import Tensor

from gradmerge import params as P
from gradmerge.errors import (
    ArgumentError,
    InputWarning,
    NotConvergedError,
    ResultOverflowError,
    StructureError,
)
from gradmerge.merge.inputs import checked_alphas
from gradmerge.params import Params

ISO_CTS_COMMON_SPACE_FRACTION = 0.8
"""Iso-CTS's share of the common subspace, c ≈ 0.8·r: the value of Marczak et al.'s experiments
(the ``common_space_fraction: 0.8`` of their code's ``config/method/iso_cts.yaml`` and README,
and of fusion-bench's ``isotropic_merging/iso_cts.yaml``)."""

MatrixRule = Callable[[list[Tensor], str], Tensor]
"""(the α-weighted task matrices Δ_t of one tensor, its name) ↦ the merged update M."""


def tsv_merge(
    base: Params,
    finetuned: Sequence[Params],
    *,
    alphas: float | Sequence[float] = 1.0,
    average: Collection[str] = (),
) -> dict[str, Tensor]:
    r"""TSV-M, Task Singular Vector merging (Gargiulo et al., CVPR 2025).

    For every 2-D tensor, with Δ_t = α_t (θ_t − θ_LLM) of shape m × n, r = min(m, n), T tasks
    and k = ⌊r/T⌋ (the papers' per-task share 1/T of the rank):

    .. math::

        \Delta_t = U_t S_t V_t^\top \ (\text{SVD}),\quad
        U = [U_t[:, :k]]_{t},\ S = \operatorname{diag}(S_t[:k])_{t},\ V = [V_t[:, :k]]_{t},

        \theta = \theta_{LLM} + \operatorname{polar}(U)\, S\, \operatorname{polar}(V)^\top,
        \qquad \operatorname{polar}(X) = P Q^\top \text{ for } X = P \Sigma Q^\top,

    polar(X) being the matrix with orthonormal columns nearest to X (orthogonal Procrustes): the
    whitening that removes the overlap between the tasks' singular vectors. When those subspaces
    are already orthogonal (left and right), the merge is Σ_t of each Δ_t truncated to rank k;
    with one task it is Δ_1 itself; with T identical tasks (or collinear ones, c_t·Δ), the
    mean (1/T)·Σ_t c_t·Δ_k of their truncations (the canonical whitening where the tasks share
    directions: module docstring). A matrix with r < T keeps no direction (k = 0): its update is
    zero, as in the reference code, with an :class:`~gradmerge.errors.InputWarning` (list it in
    ``average``). Every other tensor, and those in ``average``, gets (1/T) Σ_t Δ_t.

    The reference code computes k as ``int(r * (1 / T))``, one less than ⌊r/T⌋ where the
    product rounds below an integer (T = 49 and r a multiple of it, for r ≤ 8192 and T ≤ 64);
    gradmerge uses ⌊r/T⌋.

    Args:
        base: θ_LLM.
        finetuned: θ_1, …, θ_T, each with the keys, shapes and dtype of ``base``.
        alphas: one α for all tasks (default 1, fusion-bench's; the authors tune α ∈ [0.1, 3]
            on validation data), or one per task, applied to each task vector before the SVDs.
        average: names of 2-D tensors to merge by the mean of the task vectors instead (the
            reference code so treats CLIP's ``text_projection``; fusion-bench's
            ``exclude_keys``).

    Returns:
        The merged parameters, a new dict with the keys, shapes and dtypes of ``base``
        (float16/bfloat16 tensors are merged in float32).

    Raises:
        StructureError, DTypeError, DeviceError: inputs that do not fit together, or an
            ``average`` name that ``base`` lacks.
        NonFiniteError: a NaN or an infinity in an input.
        ArgumentError: no fine-tuned model, or a wrong number of alphas.
        ResultOverflowError: the weighted task vectors or the merge overflow the dtype.

    Example:
        >>> import torch, gradmerge as gm
        >>> base = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
        >>> a = {"w": torch.tensor([[3.0, 0.0], [0.0, 1.0]]), "b": torch.tensor([1.0, 0.0])}
        >>> b = {"w": torch.tensor([[0.0, 0.0], [0.0, 2.0]]), "b": torch.tensor([0.0, 1.0])}
        >>> merged = gm.tsv_merge(base, [a, b])  # each keeps its top direction: 3·e1e1ᵀ, 2·e2e2ᵀ
        >>> merged["w"].abs(), merged["b"]
        (tensor([[3., 0.],
                [0., 2.]]), tensor([0.5000, 0.5000]))
    """
    return _merge("tsv_merge", base, finetuned, alphas, average, _tsv)


def iso_c(
    base: Params,
    finetuned: Sequence[Params],
    *,
    alphas: float | Sequence[float] = 1.0,
    average: Collection[str] = (),
) -> dict[str, Tensor]:
    r"""Iso-C, isotropic merging in the common subspace (Marczak et al., ICML 2025).

    For every 2-D tensor, with Δ_t = α_t (θ_t − θ_LLM) and r = min(m, n):

    .. math::

        \sum_t \Delta_t = U S V^\top\ (\text{SVD}),\qquad
        \theta = \theta_{LLM} + \bar\sigma\, U V^\top,\quad
        \bar\sigma = \tfrac{1}{r} \operatorname{tr} S,

    the task-arithmetic sum with its spectrum made flat (every singular value replaced by their
    mean): the same singular vectors and the same nuclear norm ‖·‖_* as the sum. Every other
    tensor, and those in ``average``, gets (1/T) Σ_t Δ_t (the reference code's mean).

    Args:
        base, finetuned, alphas, average: as :func:`tsv_merge` (α default 1: fusion-bench's
            ``scaling_factor: 1.0``; the authors tune α ∈ [0.1, 3] on validation data).

    Returns:
        The merged parameters (keys, shapes and dtypes of ``base``).

    Raises:
        As :func:`tsv_merge`.

    Example:
        >>> import torch, gradmerge as gm
        >>> base = {"w": torch.zeros(2, 2)}
        >>> a, b = {"w": torch.diag(torch.tensor([3.0, 0.0]))}, {"w": torch.diag(torch.tensor([0.0, 1.0]))}
        >>> gm.iso_c(base, [a, b])["w"]  # σ(a + b) = (3, 1) becomes (2, 2)
        tensor([[2., 0.],
                [0., 2.]])
    """
    return _merge("iso_c", base, finetuned, alphas, average, _iso_c)


def iso_cts(
    base: Params,
    finetuned: Sequence[Params],
    *,
    alphas: float | Sequence[float] = 1.0,
    common_space_fraction: float = ISO_CTS_COMMON_SPACE_FRACTION,
    average: Collection[str] = (),
) -> dict[str, Tensor]:
    r"""Iso-CTS, isotropic merging in common and task-specific subspaces (Marczak et al., ICML
    2025).

    For every 2-D tensor, with Δ_t = α_t (θ_t − θ_LLM), r = min(m, n) and (c, n) =
    :func:`iso_cts_split` (r, T, ``common_space_fraction``):

    .. math::

        \sum_t \Delta_t = U S V^\top,\qquad
        (I - U_c U_c^\top)\,\Delta_t = U_t S_t V_t^\top\quad (U_c = U[:, :c]),

        \hat U = [U_1[:, :n], \dots, U_T[:, :n], U_c],\quad
        \hat V = [V_1[:, :n], \dots, V_T[:, :n], V_c],\quad
        \hat s = (S_1[:n], \dots, S_T[:n], S[:c]),

        \theta = \theta_{LLM} + \bar s\, \operatorname{polar}(\hat U)\,
            \operatorname{polar}(\hat V)^\top,
        \qquad \bar s = \operatorname{mean}(\hat s),

    with polar as in :func:`tsv_merge`: the common subspace of the sum, its least directions
    replaced by each task's strongest directions outside it, orthogonalised, with a flat
    spectrum. With ``common_space_fraction`` = 1 (or n = 0) it is :func:`iso_c`. Every other
    tensor, and those in ``average``, gets (1/T) Σ_t Δ_t.

    Args:
        base, finetuned, alphas, average: as :func:`tsv_merge`.
        common_space_fraction: f ∈ [0, 1], the share of the r directions kept from the sum
            (default :data:`ISO_CTS_COMMON_SPACE_FRACTION` = 0.8, the paper's).

    Returns:
        The merged parameters (keys, shapes and dtypes of ``base``).

    Raises:
        ArgumentError: f outside [0, 1], or so small for a matrix that the task-specific
            directions outnumber its rank (:func:`iso_cts_split`); otherwise as :func:`tsv_merge`.

    Example:
        >>> import torch, gradmerge as gm
        >>> base = {"w": torch.zeros(3, 3)}
        >>> a, b = {"w": torch.diag(torch.tensor([4.0, 1.0, 0.0]))}, {"w": torch.diag(torch.tensor([0.0, 0.0, 2.0]))}
        >>> # f = 0.4: c = 1 direction of a + b (e1, σ = 4), n = 1 of each task outside it
        >>> # (e2, σ = 1; e3, σ = 2), all three at σ̄ = 7/3
        >>> gm.iso_cts(base, [a, b], common_space_fraction=0.4)["w"].diagonal()
        tensor([2.3333, 2.3333, 2.3333])
    """
    fraction = _fraction(common_space_fraction)
    return _merge("iso_cts", base, finetuned, alphas, average, partial(_iso_cts, fraction=fraction))


def iso_cts_split(rank: int, tasks: int, fraction: float) -> tuple[int, int]:
    """Iso-CTS's (c, n): c directions of the common subspace, n of each task's own.

    As the reference code computes them: c_0 = ⌊f·r⌋, then the r − c_0 remaining directions are
    rounded to a multiple of T so that every task gets as many, T·n = T·round((r − c_0)/T)
    (Python's ``round``: halves to even), and c = r − T·n.

    Raises:
        ArgumentError: that rounding gives the tasks more than r directions (c < 0, only for a
            small f): use a larger ``common_space_fraction``.

    Example:
        >>> iso_cts_split(768, 8, 0.8), iso_cts_split(10, 3, 0.8), iso_cts_split(2, 4, 0.8)
        ((616, 19), (7, 1), (2, 0))
    """
    first = int(rank * fraction)
    specific = round((rank - first) / tasks) * tasks
    common = rank - specific
    if common < 0:
        raise ArgumentError(
            f"iso_cts: common_space_fraction = {fraction:g} leaves {rank - first} of a matrix's "
            f"{rank} directions to {tasks} tasks, which rounds to {specific} > {rank}: use a "
            f"larger common_space_fraction (the paper's {ISO_CTS_COMMON_SPACE_FRACTION})"
        )
    return common, specific // tasks


# ----- the merge of one matrix --------------------------------------------------------------------
def _tsv(deltas: list[Tensor], key: str) -> Tensor:
    rank, tasks = min(deltas[0].shape), len(deltas)
    k = rank // tasks
    if k == 0:
        warnings.warn(
            f"tsv_merge: {key!r} has rank at most {rank} < {tasks} tasks, so each task keeps "
            f"⌊{rank}/{tasks}⌋ = 0 singular directions and its merged update is zero (as in the "
            "reference code); list it in `average` to merge it by the mean of the task vectors",
            InputWarning,
            stacklevel=4,
        )
        return torch.zeros_like(deltas[0])
    parts = [_svd(delta, key) for delta in deltas]
    u = torch.cat([p[0][:, :k] for p in parts], dim=1)
    s = torch.cat([p[1][:k] for p in parts])
    vh = torch.cat([p[2][:k] for p in parts], dim=0)
    _warn_if_arbitrary("tsv_merge", key, [p[1][:k] for p in parts], deltas[0].shape)
    cuts = [(p[1], k) for p in parts]
    _warn_if_tied("tsv_merge", key, cuts, deltas[0].shape)
    tol = _accuracy(cuts, deltas[0].shape)
    return (_polar(u, key, tol) * s) @ _polar(vh, key, tol)


def _iso_c(deltas: list[Tensor], key: str) -> Tensor:
    u, s, vh = _svd(torch.stack(deltas).sum(0), key)
    _warn_if_arbitrary("iso_c", key, [s], deltas[0].shape)
    return s.mean() * (u @ vh)


def _iso_cts(deltas: list[Tensor], key: str, *, fraction: float) -> Tensor:
    common, n = iso_cts_split(min(deltas[0].shape), len(deltas), fraction)
    u, s, vh = _svd(torch.stack(deltas).sum(0), key)
    uc, sc, vhc = u[:, :common], s[:common], vh[:common]
    us, ss, vhs, spectra = [], [], [], []
    if n > 0:
        for delta in deltas:
            ut, st, vht = _svd(delta - uc @ (uc.mT @ delta), key)  # Δ_t off the common subspace
            spectra.append(st)
            us.append(ut[:, :n])
            ss.append(st[:n])
            vhs.append(vht[:n])
    _warn_if_arbitrary("iso_cts", key, [sc, *ss], deltas[0].shape)
    cuts = [(s, common), *((st, n) for st in spectra)]
    _warn_if_tied("iso_cts", key, cuts, deltas[0].shape)
    tol = _accuracy(cuts, deltas[0].shape)
    kept = torch.cat([*ss, sc])
    u_hat = _polar(torch.cat([*us, uc], dim=1), key, tol)
    vh_hat = _polar(torch.cat([*vhs, vhc], dim=0), key, tol)
    return kept.mean() * (u_hat @ vh_hat)


def _svd(x: Tensor, key: str) -> tuple[Tensor, Tensor, Tensor]:
    try:
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
    except torch.linalg.LinAlgError as err:  # LAPACK's iteration did not converge
        raise NotConvergedError(
            f"the singular value decomposition of a {tuple(x.shape)} matrix of {key!r} did not "
            f"converge ({err}); compute in float64"
        ) from err
    return u, s, vh


def _polar(x: Tensor, key: str, tol: float = 0.0) -> Tensor:
    r"""P Qᵀ for X = P Σ Qᵀ: the nearest matrix with orthonormal columns (rows, if X is wide);
    where X is rank-deficient to within ``tol`` (:func:`_accuracy`), its canonical polar factor,
    the partial isometry on X's range.

    X's columns are the tasks' kept singular vectors, concatenated. When tasks share directions
    (identical or collinear task matrices: U = [A, A]), X has singular values that are zero in
    exact arithmetic and rounding in the computed SVD. Their P and Q columns are arbitrary —
    another dtype or SVD routine picks others — and P Qᵀ gives them full weight: for
    U = [A, A], V = [B, B] that adds a spurious P₀ S_k Q₀ᵀ to TSV-M's merge, the task's own
    spectrum along directions no task has (0.4-0.7 between float32 and float64 for two
    byte-identical fine-tunes). The canonical factor drops them,

    .. math:: W = X (X^\top X)^{+1/2} = P_r Q_r^\top\quad
              (\text{the } \sigma_i > \tau\,\sigma_{\max},\ \tau = \max(\mathrm{tol},
              \sqrt{\max(m, n)}\,\varepsilon)),

    unique whatever the basis (X = W |X|, W and X sharing their kernel) and equal to P Qᵀ when
    X has full rank. For T identical or collinear tasks c_t·Δ it makes TSV-M's merge
    (1/T)·Σ_t c_t·Δ_k, Δ_k the rank-k truncation of Δ: merging a task with itself gives that
    task, truncated — the basis-independent answer.
    """
    p, s, qh = _svd(x, key)
    if s.numel() == 0:
        return p @ qh
    cut = max(tol, max(x.shape) ** 0.5 * torch.finfo(s.dtype).eps) * s[0]
    kept = s > cut
    if bool(kept.all()):
        return p @ qh
    return p[:, kept] @ qh[kept]


def _accuracy(cuts: list[tuple[Tensor, int]], shape: torch.Size) -> float:
    """τ: how far from orthonormal-and-distinct the concatenated singular vectors can be known,
    relative to the largest singular value of their concatenation — below it, two tasks'
    directions are the same direction computed twice.

    A decomposition that keeps its top k singular vectors of an m × n matrix (singular values
    σ) gives their span to within sin Θ ≲ ‖E‖/(σ_k − σ_(k+1)) (Wedin), E the SVD's backward
    error, ‖E‖ ≈ √max(m, n)·ε·σ_1: so τ = √max(m, n)·ε·max σ_1/(σ_k − σ_(k+1)) over the
    decompositions (``cuts``: their singular values and how many they keep; keeping all of
    them, the ratio is 1), capped at √ε (a tie at the cut gives ∞: :func:`_warn_if_tied`).
    Measured: no direction dropped for independent random tasks in float64 (768 × 768, T = 2
    and 3: τ ≈ 1e-11, smallest singular value ≥ 1.7e-4); in float32 τ reaches the cap and
    drops, in 1 of 12 such draws, one direction whose singular value (5e-5) lay below the
    uncapped accuracy (about 3e-3): rounding, not signal.
    """
    dtype = cuts[0][0].dtype
    ratio = 1.0
    for values, k in cuts:
        if 0 < k < values.numel() and bool(values[0] > 0):
            gap = float(values[k - 1] - values[k])
            ratio = max(ratio, float(values[0]) / gap if gap > 0 else math.inf)
    eps = torch.finfo(dtype).eps
    return min(max(shape) ** 0.5 * eps * ratio, eps**0.5)


def _warn_if_arbitrary(method: str, key: str, parts: list[Tensor], shape: torch.Size) -> None:
    """Warn when a kept singular value is zero at the precision of the SVD although the matrix
    is not: its singular vectors are arbitrary, and the merge gives them weight (module
    docstring).

    ``parts``: the kept singular values, one tensor per decomposition (TSV-M: each task's;
    Iso-C: the sum's; Iso-CTS: the sum's common ones and each task's own), each judged against
    its own largest: zero means σ ≤ √max(m, n)·ε·σ_max, or a decomposition of a zero matrix.
    The bound separates what rounding leaves of a stored low-rank float32 matrix (≤ 11.2·ε·σ_max
    measured, ranks 1-16, up to 1536 × 384) from the least singular value of full-rank ones
    (≥ 68.8·ε·σ_max over 200 Gaussian 384 × 384 float32 matrices), where a floor of
    max(m, n)·ε·σ_max (the usual numerical rank) would warn about 2.5% of the full-rank ones
    (proofs_tests/unit/merge/test_spectral.py checks both sides on fresh draws).
    """
    parts = [p for p in parts if p.numel()]
    if not parts or not any(bool((p > 0).any()) for p in parts):
        return  # nothing kept, or a matrix no task changed: the merge is exact (zero)
    floor = max(shape) ** 0.5 * torch.finfo(parts[0].dtype).eps
    zero = sum(int((p <= floor * p.max()).sum()) for p in parts)
    if zero:
        warnings.warn(
            f"{method}: {key!r} ({shape[0]}×{shape[1]}) keeps {zero} singular direction(s) with "
            "singular value 0 (a task matrix of lower rank than the directions kept, e.g. a LoRA "
            "update or a layer a fine-tune left unchanged): their singular vectors are arbitrary "
            "and take part in the merge, so this matrix's result depends on the SVD routine, as "
            "in the reference code; list it in `average` to merge it by the mean of the task "
            "vectors",
            InputWarning,
            stacklevel=4,
        )


def _warn_if_tied(method: str, key: str, cuts: list[tuple[Tensor, int]], shape: torch.Size) -> None:
    """Warn when a decomposition keeps its top k singular directions and σ_k = σ_(k+1) at the
    precision of the SVD (within √max(m, n)·ε·σ_max, the floor of :func:`_warn_if_arbitrary`):
    which of the tied directions are kept is then arbitrary, and so is the merge of this
    matrix. ``cuts``: (a decomposition's singular values, how many it keeps). A tie of zeros
    (nothing left to keep) is :func:`_warn_if_arbitrary`'s case, not this one."""
    tied = 0
    for values, k in cuts:
        if not 0 < k < values.numel() or not bool(values[0] > 0):
            continue
        floor = max(shape) ** 0.5 * torch.finfo(values.dtype).eps * values[0]
        if values[k - 1] > floor and values[k - 1] - values[k] <= floor:
            tied += 1
    if tied:
        warnings.warn(
            f"{method}: {key!r} ({shape[0]}×{shape[1]}) keeps its top singular directions where "
            f"the singular values tie at the cut in {tied} decomposition(s) (σ_k = σ_(k+1) to the "
            "dtype's precision): which of the tied directions are kept is arbitrary, so this "
            "matrix's result depends on the SVD routine; list it in `average` to merge it by "
            "the mean of the task vectors",
            InputWarning,
            stacklevel=4,
        )


# ----- the driver: every tensor -------------------------------------------------------------------
def _merge(
    method: str,
    base: Params,
    finetuned: Sequence[Params],
    alphas: float | Sequence[float],
    average: Collection[str],
    rule: MatrixRule,
) -> dict[str, Tensor]:
    """θ_LLM + M(Δ_1, …, Δ_T) on every matrix, θ_LLM + mean_t Δ_t on every other tensor."""
    if len(finetuned) == 0:
        raise ArgumentError(
            f"{method} needs at least one fine-tuned model, got none: pass finetuned=[θ_1, ...]"
        )
    P.check_params(base, name="base")
    for t, ft in enumerate(finetuned):
        P.check_params(ft, name=f"finetuned[{t}]")
        P.check_compatible(base, ft, ref_name="base", name=f"finetuned[{t}]")
    weights = checked_alphas(alphas, len(finetuned), dtype=next(iter(base.values())).dtype)
    if isinstance(average, str):
        raise ArgumentError(f"average must be a collection of names, got the string {average!r}")
    unknown = [k for k in average if k not in base]
    if unknown:
        raise StructureError(
            f"average names {unknown[0]!r}, which base does not have: name 2-D tensors of the "
            f"models, e.g. {next(iter(base))!r}"
        )
    merged = {}
    with torch.no_grad():
        for key, theta in base.items():
            work = torch.float32 if theta.dtype in (torch.float16, torch.bfloat16) else theta.dtype
            origin = theta.to(work)
            deltas = [
                a * (ft[key].to(work) - origin) for a, ft in zip(weights, finetuned, strict=True)
            ]
            _check_finite(method, key, deltas, weights, "the α-weighted task vectors")
            if theta.ndim == 2 and key not in average:
                update = rule(deltas, key)
            else:
                update = torch.stack(deltas).mean(0)
            merged[key] = (origin + update).to(theta.dtype)
            _check_finite(method, key, [merged[key]], weights, "the merge")
    return merged


def _check_finite(
    method: str, key: str, tensors: list[Tensor], weights: list[float], what: str
) -> None:
    if all(bool(torch.isfinite(t).all()) for t in tensors):
        return
    dtype = str(tensors[0].dtype).removeprefix("torch.")
    raise ResultOverflowError(
        f"{method}: {what} of {key!r} overflowed {dtype} to Inf/NaN although every input is "
        f"finite (largest |α| = {max(abs(a) for a in weights):.3e}): use smaller α, or compute "
        "in float64"
    )


def _fraction(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ArgumentError(
            f"common_space_fraction must be a number in [0, 1] (the share of a matrix's "
            f"directions kept from the sum of the task matrices), got {value!r}; the paper's is "
            f"{ISO_CTS_COMMON_SPACE_FRACTION}"
        )
    return float(value)
