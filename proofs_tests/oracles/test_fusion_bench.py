"""gm.tsv_merge, gm.iso_c and gm.iso_cts against fusion-bench's implementations (an external oracle).

fusion-bench (FusionBench, the model-merging benchmark) implements TSV-M
(``fusion_bench/method/task_singular_vector/utils/TSVM_utils.py``:
``compute_and_sum_svd_mem_reduction``) and Iso-C / Iso-CTS
(``fusion_bench/method/isotropic_merging/iso_utils.py``: ``iso_c``, ``iso_cts``) as functions of a
list of task-vector state dicts, transcribed from the papers' own code. The package's top-level
import pulls Lightning, Hydra, transformers and more, so the test-time oracle is those two source
files of the INSTALLED package (``pip install --no-deps fusion-bench==0.2.33``, as ``make setup``
does), executed as they are with the only two fusion-bench names they import stood in for: the
timing context manager ``timeit_context`` (a no-op here) and the type alias ``StateDictType``.
The merge around them is the algorithm classes' ``run`` (θ_LLM + α·merged task vector; a list of
α scales the task vectors before the merge, as TSV-M's class does).

Cases: random float64 models (matrices tall, wide, square and 1 × n, biases, a convolution kernel,
a scalar) and hypothesis-drawn matrices, T = 1..5 tasks, Iso-CTS fractions in [0.5, 1] (smaller
ones make the reference slice with a negative index: gm.iso_cts refuses them, tested in
proofs_tests/unit/merge/test_spectral.py). Outputs agree to 1e-9 (float64; measured ≤ 1e-13).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
import types
import warnings
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradmerge as gm

DT = torch.float64
TOL = {"rtol": 0.0, "atol": 1e-9}


def _fusion_bench_root() -> str:
    spec = importlib.util.find_spec("fusion_bench")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fusion-bench (test oracle) is not installed: make setup installs it")
    return next(iter(spec.submodule_search_locations))


@contextlib.contextmanager
def _stand_ins() -> Iterator[None]:
    """The fusion-bench names the two files import, only while they are executed."""
    utils = types.ModuleType("fusion_bench.utils")
    utils.timeit_context = lambda *args, **kwargs: contextlib.nullcontext()  # type: ignore[attr-defined]
    typing = types.ModuleType("fusion_bench.utils.type")
    typing.StateDictType = dict  # type: ignore[attr-defined]
    stand_ins = {
        "fusion_bench": types.ModuleType("fusion_bench"),
        "fusion_bench.utils": utils,
        "fusion_bench.utils.type": typing,
    }
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _load(root: str, relative: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"oracle_{relative.replace('/', '_')}", f"{root}/{relative}"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with _stand_ins():
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def oracle() -> types.SimpleNamespace:
    root = _fusion_bench_root()
    tsv = _load(root, "method/task_singular_vector/utils/TSVM_utils.py")
    iso = _load(root, "method/isotropic_merging/iso_utils.py")
    return types.SimpleNamespace(
        tsv_merge=lambda tvs, f: tsv.compute_and_sum_svd_mem_reduction(tvs, accelerator="cpu"),
        iso_c=lambda tvs, f: iso.iso_c(tvs, accelerator="cpu"),
        iso_cts=lambda tvs, f: iso.iso_cts(tvs, common_space_fraction=f, accelerator="cpu"),
    )


OURS = {
    "tsv_merge": lambda base, fts, alphas, f: gm.tsv_merge(base, fts, alphas=alphas),
    "iso_c": lambda base, fts, alphas, f: gm.iso_c(base, fts, alphas=alphas),
    "iso_cts": lambda base, fts, alphas, f: gm.iso_cts(
        base, fts, alphas=alphas, common_space_fraction=f
    ),
}


def _reference(oracle, method, base, fts, alphas, fraction):
    """fusion-bench's merge: task vectors (each times its α when α is a list), the method, then
    θ_LLM + α·merged for one α."""
    per_task = isinstance(alphas, list)
    tvs = [
        {k: (alphas[t] if per_task else 1.0) * (ft[k] - base[k]) for k in base}
        for t, ft in enumerate(fts)
    ]
    with contextlib.redirect_stdout(io.StringIO()):  # the oracle prints each key it merges
        merged = getattr(oracle, method)(tvs, fraction)
    scale = 1.0 if per_task else alphas
    return {k: base[k] + scale * merged[k] for k in base}


def _model(seed: int, tasks: int) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "embed.weight": (13, 6),  # 2-D: merged as a matrix, as both references do
        "attn.q.weight": (6, 6),
        "mlp.up.weight": (24, 6),  # r = 6: Iso-CTS keeps task-specific directions for T ≤ 3
        "mlp.down.weight": (6, 24),
        "mlp.down.bias": (6,),
        "norm.weight": (6,),
        "conv.weight": (4, 2, 3, 3),  # not 2-D: the mean
        "head.weight": (1, 6),
        "temperature": (),
    }
    base = {k: torch.randn(s, generator=g, dtype=DT) for k, s in shapes.items()}
    fts = [
        {k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=DT) for k, v in base.items()}
        for _ in range(tasks)
    ]
    return base, fts


CASES = [  # (method, tasks, alphas, common_space_fraction)
    *[(m, t, 1.0, 0.8) for m in OURS for t in (1, 2, 3, 5)],
    *[(m, 3, 0.6, 0.8) for m in OURS],
    *[(m, 3, [0.3, 1.2, 0.7], 0.8) for m in OURS],
    ("iso_cts", 2, 1.0, 0.5),
    ("iso_cts", 3, 1.0, 1.0),
]


@pytest.mark.parametrize(("method", "tasks", "alphas", "fraction"), CASES)
def test_equals_fusion_bench_on_a_small_model(oracle, method, tasks, alphas, fraction):
    base, fts = _model(seed=tasks, tasks=tasks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gm.InputWarning)  # head.weight: r = 1 < T for TSV-M
        got = OURS[method](base, fts, alphas, fraction)
    expected = _reference(oracle, method, base, fts, alphas, fraction)
    assert list(got) == list(base)
    for k, v in expected.items():
        assert got[k].shape == base[k].shape and got[k].dtype == DT
        torch.testing.assert_close(got[k], v, **TOL, msg=lambda m, k=k: f"{method} {k}: {m}")


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 12),
    cols=st.integers(1, 12),
    tasks=st.integers(1, 5),
    fraction=st.floats(0.5, 1.0),
    method=st.sampled_from(sorted(OURS)),
)
def test_equals_fusion_bench_on_drawn_matrices(oracle, seed, rows, cols, tasks, fraction, method):
    g = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(rows, cols, generator=g, dtype=DT)}
    fts = [{"w": base["w"] + torch.randn(rows, cols, generator=g, dtype=DT)} for _ in range(tasks)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gm.InputWarning)  # TSV-M with min(rows, cols) < tasks
        got = OURS[method](base, fts, 1.0, fraction)
    expected = _reference(oracle, method, base, fts, 1.0, fraction)
    torch.testing.assert_close(got["w"], expected["w"], **TOL)
