"""The compiled single-loop kernels of Eq. 6 (gradmerge.kernels.fused) against the chunked path.

Given ``kernel=Fused("on")`` and the size threshold lowered, `gm.gradient_matching` (and task
arithmetic / Fisher averaging) take a compiled kernel; by default the kernel the streaming engine
takes (the C loop on a CPU); with ``kernel=None`` the chunked pass, itself bit-identical to the
operator algebra (test_elementwise_merge.py). The two must agree bit for
bit, give the same errors, and the streaming engine must write the same bytes either way. Both
backends run on a CPU here: "native" (gradmerge.kernels.native, the C loop CPU float32/float64 tensors
take) and "inductor" (torch.compile, what GPUs and other dtypes take; CPU tensors are routed to
it by making the C loop decline them). Each inductor pattern (which curvatures are tensors)
compiles once per process (~2 s), so the patterns here are few and fixed; hypothesis varies
values, sizes and weights within them.
"""

import ctypes
import re
import stat
import warnings
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import gradmerge as gm
from gradmerge.curvature.diagonal import unchecked
from gradmerge.jobs import MergeConfig, engine, run_merge
from gradmerge.kernels import Fused, select
from gradmerge.kernels import fused as _fused
from gradmerge.kernels import memory as _memory
from gradmerge.kernels import native as _native

# every size above 4096: inductor specialises its loops below that (a second compile)
SHAPES = {"big": (5003,), "mat": (71, 80)}


@pytest.fixture(autouse=True)
def small_threshold(monkeypatch):
    monkeypatch.setattr(_fused, "MIN_NUMEL", 4097)


BACKENDS = ["native", "inductor"]
KERNELS = {"on": Fused("on"), "off": None}
"""The in-memory rules' ``kernel=`` for each mode: the compiled loops, or none (chunked pass)."""


@contextmanager
def backend(name):
    """CPU float tensors take the C loop ("native") or torch.compile's kernel ("inductor")."""
    if name == "native":
        yield
    else:
        with mock.patch.object(_native, "supports", lambda *args: False):
            yield


@pytest.fixture(params=BACKENDS)
def compiled(request):
    """The backend's name; skips (with the reason) where it cannot build its kernel here."""
    a = torch.ones(5000)
    with backend(request.param), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = _fused.merge_tensor(a, [a], [1.0], [1.0, 0.0])
    if out is None:
        pytest.skip(f"no compiled kernel here: {_fused._failed}")
    with backend(request.param):
        yield request.param


def _params(gen, scale=1.0, shapes=SHAPES):
    return {
        k: scale * torch.randn(s, generator=gen, dtype=torch.float32) for k, s in shapes.items()
    }


def _diag(gen, shapes=SHAPES, dtype=torch.float32):
    return gm.Diagonal({k: (torch.rand(s, generator=gen) * 3).to(dtype) for k, s in shapes.items()})


def _both(fn):
    return fn(KERNELS["on"]), fn(KERNELS["off"])


PATTERNS = {  # (prior, task curvatures): "delta" a float, "diag" a Diagonal
    "fisher-like": ("delta", ["diag"]),
    "all diagonal": ("diag", ["diag", "diag"]),
    "task arithmetic": ("delta", ["delta", "delta"]),
    "mixed": ("delta", ["diag", "delta", "diag"]),
}


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    pattern=st.sampled_from(sorted(PATTERNS)),
    alphas=st.lists(st.floats(0.05, 3.0), min_size=3, max_size=3),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_compiled_kernel_is_bit_identical_to_the_chunked_path(
    name, seed, pattern, alphas, scale, dtype
):
    if name == "inductor" and dtype == torch.float64:
        return  # one more compile per pattern; float64 is the C loop's case
    gen = torch.Generator().manual_seed(seed)
    prior_kind, kinds = PATTERNS[pattern]
    base = {k: v.to(dtype) for k, v in _params(gen, scale).items()}
    fts = [{k: v.to(dtype) for k, v in _params(gen, scale).items()} for _ in kinds]
    prior = 0.37 if prior_kind == "delta" else _diag(gen, dtype=dtype) + 0.1
    hs = [1.7 if k == "delta" else _diag(gen, dtype=dtype) for k in kinds]
    weights = alphas[: len(kinds)]
    with backend(name):
        fused = gm.gradient_matching(
            base, fts, hs, prior=prior, alphas=weights, kernel=KERNELS["on"]
        )
    if _fused._failed:
        pytest.skip(f"no compiled kernel here: {_fused._failed}")
    chunked = gm.gradient_matching(base, fts, hs, prior=prior, alphas=weights, kernel=None)
    for k in base:
        assert fused[k].dtype == dtype
        assert torch.equal(fused[k], chunked[k]), k


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    kinds=st.sampled_from([("diag", "diag"), ("delta", "diag", "delta")]),
    shift=st.sampled_from([(1.0, 1e-3), (0.37, 0.25), (3.0, 1e-6)]),
    value_scale=st.sampled_from([1e-3, 1.0, 1e3]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_a_shifted_prior_formed_in_the_loop_is_bit_identical(
    name, seed, kinds, shift, value_scale, dtype
):
    """A prior δ·I + s·C made lazily (``C.shifted(s, δ)``, as the streaming engine makes it):
    the C loop forms each h_0 = (c·s) + δ itself and never the tensor; the result equals, bit
    for bit, the chunked pass with the eager prior ``C.scaled(s) + δ``."""
    if name == "inductor" and dtype == torch.float64:
        return
    gen = torch.Generator().manual_seed(seed)
    base = {k: v.to(dtype) for k, v in _params(gen, value_scale).items()}
    fts = [{k: v.to(dtype) for k, v in _params(gen, value_scale).items()} for _ in kinds]
    c = _diag(gen, dtype=dtype)
    hs = [1.7 if k == "delta" else _diag(gen, dtype=dtype) for k in kinds]
    lazy = c.shifted(*shift)
    with backend(name):
        fused = gm.gradient_matching(base, fts, hs, prior=lazy, alphas=0.8, kernel=KERNELS["on"])
    if _fused._failed:
        pytest.skip(f"no compiled kernel here: {_fused._failed}")
    assert lazy.formed is (name == "inductor")  # the C loop never forms the prior's values
    eager = c.scaled(shift[0]) + shift[1]
    chunked = gm.gradient_matching(base, fts, hs, prior=eager, alphas=0.8, kernel=None)
    for k in base:
        assert torch.equal(fused[k], chunked[k]), k


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (float("nan"), gm.NonFiniteError, r"prior\['big'\]"),
        (float("inf"), gm.NonFiniteError, r"prior\['big'\]"),
        (-1.0, gm.NotPositiveDefiniteError, "prior is not positive semi-definite"),
    ],
)
def test_a_bad_value_in_a_shifted_prior_is_diagnosed_as_on_the_chunked_path(bad, error, message):
    """The loop counts the element (θ not finite, or h_0 < 0) and hands the tensor to the
    chunked path, whose exact checks name the prior, in either mode."""
    gen = torch.Generator().manual_seed(9)
    base, fts, hs = _params(gen), [_params(gen), _params(gen)], [_diag(gen), _diag(gen)]
    c = _diag(gen)
    c.values["big"][4321] = bad
    for mode in ("on", "off"):
        prior = unchecked(c.values).shifted(0.5, 0.1)  # read lazily, as from a file
        with pytest.raises(error, match=message):
            gm.gradient_matching(base, fts, hs, prior=prior, kernel=KERNELS[mode])


@pytest.mark.usefixtures("compiled")
def test_task_arithmetic_and_fisher_averaging_take_the_kernel_bit_identically():
    gen = torch.Generator().manual_seed(3)
    base, fts = _params(gen), [_params(gen), _params(gen)]
    hs = [_diag(gen), _diag(gen)]
    for fn in (
        lambda kernel: gm.task_arithmetic(base, fts, alphas=[0.3, 0.9], kernel=kernel),
        lambda kernel: gm.fisher_average(fts, hs, alphas=[0.6, 0.4], kernel=kernel),
    ):
        fused, chunked = _both(fn)
        assert all(torch.equal(fused[k], chunked[k]) for k in base)


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("where", ["base", "finetuned[1]", "curvatures[0]"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_are_named_as_on_the_chunked_path(where, bad):
    gen = torch.Generator().manual_seed(1)
    base, fts, hs = _params(gen), [_params(gen), _params(gen)], [_diag(gen), _diag(gen)]
    target = {"base": base, "finetuned[1]": fts[1], "curvatures[0]": hs[0].values}[where]
    target["big"][4321] = bad
    for mode in ("on", "off"):
        with pytest.raises(gm.NonFiniteError, match=re.escape(f"{where}['big']")):
            gm.gradient_matching(base, fts, hs, prior=0.1, kernel=KERNELS[mode])


@pytest.mark.usefixtures("compiled")
def test_negative_curvature_and_singular_systems_give_the_same_errors():
    gen = torch.Generator().manual_seed(2)
    base, fts = _params(gen), [_params(gen)]
    negative = _diag(gen)
    negative.values["big"][17] = -1.0
    zero = gm.Diagonal({k: torch.zeros(s) for k, s in SHAPES.items()})
    cases = [
        ([negative], 2.0, r"curvatures\[0\] is not positive"),
        ([zero], 0.0, "diagonal system"),
        ([0.0], 0.0, "δ·I"),
    ]
    for hs, prior, message in cases:
        for mode in ("on", "off"):
            with pytest.raises(gm.NotPositiveDefiniteError, match=message):
                gm.gradient_matching(base, fts, hs, prior=prior, kernel=KERNELS[mode])


@pytest.mark.parametrize("name", BACKENDS)
def test_a_kernel_that_cannot_be_built_warns_once_and_falls_back(monkeypatch, name):
    def broken(*pattern):
        def kernel(*args):
            raise RuntimeError("no C++ compiler")

        return kernel

    monkeypatch.setattr(_fused, "_kernel", broken)
    monkeypatch.setattr(_native, "_function", broken)
    monkeypatch.setattr(_fused, "_failed", {})
    if name == "inductor":
        monkeypatch.setattr(_native, "supports", lambda *args: False)
    gen = torch.Generator().manual_seed(4)
    base, fts, hs = _params(gen), [_params(gen)], [_diag(gen)]
    with pytest.warns(RuntimeWarning, match="no C.. compiler"):
        fused = gm.gradient_matching(base, fts, hs, prior=0.5, kernel=KERNELS["on"])
    chunked = gm.gradient_matching(base, fts, hs, prior=0.5, kernel=None)
    assert all(torch.equal(fused[k], chunked[k]) for k in base)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the failure is remembered: no second attempt or warning
        gm.gradient_matching(base, fts, hs, prior=0.5, kernel=KERNELS["on"])


def test_modes_and_the_auto_threshold(monkeypatch):
    big = _fused.MIN_NUMEL
    monkeypatch.setattr(_fused, "AUTO_MIN_WORK", 3 * big)
    monkeypatch.delenv(_fused.ENV, raising=False)
    assert _fused.mode() == "auto"
    assert not _fused.wanted([big, big, big - 1], "auto")  # the small tensor does not count
    assert _fused.wanted([big, 2 * big], "auto")
    assert _fused.wanted([1], "on") and not _fused.wanted([10 * big], "off")
    with gm.fused_kernels("off"):
        assert select([10 * big]) is None  # a job never overrides an explicit "off"
        assert _fused.mode() == "off"
    large_job = select([big] * 3)  # a large job switches "auto" on for its small calls
    assert large_job is not None and large_job.mode == "on"
    small_job = select([big])
    assert small_job is not None and small_job.mode == "auto"
    assert _fused.mode() == "auto"
    monkeypatch.setenv(_fused.ENV, "OFF")
    assert _fused.mode() == "off" and select([10 * big]) is None
    monkeypatch.setenv(_fused.ENV, "fast")
    with pytest.raises(gm.ArgumentError, match=r"\$GRADMERGE_FUSED: expected one of auto, on, off"):
        _fused.mode()
    with pytest.raises(gm.ArgumentError, match="got 'yes'"), gm.fused_kernels("yes"):
        pass
    with pytest.raises(gm.ArgumentError, match="got 'off'"):
        Fused("off")


def _refuse_kernels(monkeypatch):
    """Make every compiled kernel and mapped output fail the test if it is used."""

    def refused(*args, **kwargs):
        raise AssertionError("a compiled kernel was used")

    monkeypatch.setattr(_native, "merge_tensor", refused)
    monkeypatch.setattr(_fused, "merge_tensor", refused)
    monkeypatch.setattr(_fused, "_kernel", refused)
    monkeypatch.setattr(_memory, "empty", refused)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_kernel_none_compiles_nothing_whatever_the_mode(monkeypatch, mode):
    """``kernel=None``: no C loop, no torch.compile, no mapped memory, in any mode; and by
    default with the mode ``"off"`` neither. The result is Eq. 6 (and Fisher averaging)."""
    _refuse_kernels(monkeypatch)
    gen = torch.Generator().manual_seed(6)
    base, fts, hs = _params(gen), [_params(gen), _params(gen)], [_diag(gen), _diag(gen)]
    with gm.fused_kernels(mode):
        merged = gm.gradient_matching(base, fts, hs, prior=0.5, kernel=None)
        averaged = gm.fisher_average(fts, hs, kernel=None)
        gm.task_arithmetic(base, fts, kernel=None)
    with gm.fused_kernels("off"):  # the default follows the mode, as the engine does
        default = gm.gradient_matching(base, fts, hs, prior=0.5)
    for k, b in base.items():  # Eq. 6 in float64 (δ = 0.5, α = 1), and Fisher averaging
        assert torch.equal(default[k], merged[k])
        b64, h64 = b.double(), [h.values[k].double() for h in hs]
        num = sum((0.5 + h) * (ft[k].double() - b64) for ft, h in zip(fts, h64, strict=True))
        torch.testing.assert_close(
            merged[k].double(), b64 + num / (0.5 + sum(h64)), rtol=1e-5, atol=1e-5
        )
        fisher = sum(h * ft[k].double() for ft, h in zip(fts, h64, strict=True)) / sum(h64)
        torch.testing.assert_close(averaged[k].double(), fisher, rtol=1e-5, atol=1e-5)


def test_by_default_the_rules_take_the_engines_kernel(monkeypatch):
    """Without ``kernel=``, the rules ask the engine's chooser (``gradmerge.kernels.select``)
    with the call's tensor sizes and take what it gives: on a CPU the C loop, for every float32
    tensor from its threshold, bit-identical to the chunked pass."""
    asked, looped = [], []
    engine_select, loop = _fused.select, _native.merge_tensor

    def spy_select(numels):
        asked.append(list(numels))
        return engine_select(numels)

    def spy_loop(base, *args):
        looped.append(base.numel())
        return loop(base, *args)

    monkeypatch.setattr(_fused, "select", spy_select)
    monkeypatch.setattr("gradmerge.kernels.select", spy_select)
    monkeypatch.setattr(_native, "merge_tensor", spy_loop)
    monkeypatch.delenv(_fused.ENV, raising=False)
    gen = torch.Generator().manual_seed(11)
    shapes = {**SHAPES, "small": (_native.MIN_NUMEL - 1,)}
    base, fts = _params(gen, shapes=shapes), [_params(gen, shapes=shapes) for _ in range(2)]
    hs = [_diag(gen, shapes), _diag(gen, shapes)]
    default = gm.gradient_matching(base, fts, hs, prior=0.3, alphas=[0.6, 1.2])
    assert asked == [[5003, 71 * 80, _native.MIN_NUMEL - 1]]
    if "native" in _fused._failed:
        pytest.skip(f"no C compiler here: {_fused._failed['native']}")
    assert looped == [5003, 71 * 80]  # the small tensor stays on the chunked pass
    chunked = gm.gradient_matching(base, fts, hs, prior=0.3, alphas=[0.6, 1.2], kernel=None)
    assert all(torch.equal(default[k], chunked[k]) for k in base)


def test_by_default_other_dtypes_take_no_compile_in_a_small_call(monkeypatch):
    """bfloat16 has no C loop; ``torch.compile`` pays off only in calls of ``AUTO_MIN_WORK``
    elements, so the default merges this call on the chunked pass, with its result."""
    gen = torch.Generator().manual_seed(12)
    base = {k: v.bfloat16() for k, v in _params(gen).items()}
    fts = [{k: v.bfloat16() for k, v in _params(gen).items()}]
    hs = [gm.Diagonal({k: v.bfloat16() for k, v in _diag(gen).values.items()})]
    chunked = gm.gradient_matching(base, fts, hs, prior=0.5, kernel=None)
    _refuse_kernels(monkeypatch)
    monkeypatch.delenv(_fused.ENV, raising=False)
    default = gm.gradient_matching(base, fts, hs, prior=0.5)
    assert all(torch.equal(default[k], chunked[k]) for k in base)


def test_by_default_a_missing_compiler_warns_once_and_falls_back(monkeypatch):
    """Where the C loop cannot be built, the default merge says so once (RuntimeWarning) and
    gives the chunked pass's result."""

    def broken(*pattern):
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(_native, "_function", broken)
    monkeypatch.setattr(_fused, "_failed", {})
    monkeypatch.delenv(_fused.ENV, raising=False)
    gen = torch.Generator().manual_seed(13)
    base, fts, hs = _params(gen), [_params(gen)], [_diag(gen)]
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        default = gm.gradient_matching(base, fts, hs, prior=0.5)
    chunked = gm.gradient_matching(base, fts, hs, prior=0.5, kernel=None)
    assert all(torch.equal(default[k], chunked[k]) for k in base)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm.gradient_matching(base, fts, hs, prior=0.5)


PRIORS = {  # the config's prior, and the in-memory H_0 it stands for (c: the prior's curvature)
    "delta": ({"delta": 1e-3}, lambda c: 1e-3),
    "delta + scale·C": (
        {"delta": 1e-3, "curvature": "prior.curvature.safetensors", "scale": 0.5},
        lambda c: c.scaled(0.5) + 1e-3,
    ),
    "delta + C": (
        {"delta": 0.25, "curvature": "prior.curvature.safetensors"},
        lambda c: c + 0.25,
    ),
}


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("prior", sorted(PRIORS))
@pytest.mark.parametrize("recycled", [False, True])
def test_streamed_merge_writes_the_same_bytes_with_and_without_the_kernel(
    tmp_path, monkeypatch, prior, recycled
):
    """Also with a prior curvature (formed inside the C loop), and with every output large
    enough to be mapped by ``_memory.empty`` (``recycled``: the engine reuses a mapping once the
    tensor on it is written, so a later output must never overwrite an earlier one)."""
    reused = []
    if recycled:  # each output written before the next is made, so that reuse is certain
        monkeypatch.setattr(engine, "WRITES_PENDING", 0)
        monkeypatch.setattr(_memory, "HUGE_FROM", 4096)
        reuse = _memory._reuse
        monkeypatch.setattr(_memory, "_reuse", lambda *a: reused.append(reuse(*a)) or reused[-1])
    shapes = {**SHAPES, "big2": SHAPES["big"]}  # two outputs of one size, one after the other
    gen = torch.Generator().manual_seed(5)
    base = _params(gen, shapes=shapes)
    fts = [_params(gen, shapes=shapes), _params(gen, shapes=shapes)]
    hs = [_diag(gen, shapes), _diag(gen, shapes)]
    c = _diag(gen, shapes)
    save_file(base, tmp_path / "base.safetensors")
    c.save(tmp_path / "prior.curvature.safetensors")
    models = []
    for t, (ft, h) in enumerate(zip(fts, hs, strict=True)):
        save_file(ft, tmp_path / f"ft{t}.safetensors")
        h.save(tmp_path / f"ft{t}.curvature.safetensors")
        models.append(
            {
                "model": f"ft{t}.safetensors",
                "curvature": f"ft{t}.curvature.safetensors",
                "alpha": 0.8,
            }
        )
    spec, h0 = PRIORS[prior]
    config = MergeConfig.from_dict(
        {
            "method": "gradient_matching",
            "base_model": "base.safetensors",
            "models": models,
            "prior": spec,
        },
        root=tmp_path,
    )
    for mode in ("on", "off"):
        with gm.fused_kernels(mode):
            run_merge(config, tmp_path / mode, progress=False)
    on, off = (tmp_path / m / "model.safetensors" for m in ("on", "off"))
    assert on.read_bytes() == off.read_bytes()
    in_memory = gm.gradient_matching(base, fts, hs, prior=h0(c), alphas=0.8)
    assert all(torch.equal(v, in_memory[k]) for k, v in load_file(on).items())
    assert any(m is not None for m in reused) is recycled
    if recycled:  # with writes pending on the background thread: the same bytes
        monkeypatch.setattr(engine, "WRITES_PENDING", 2)
        with gm.fused_kernels("on"):
            run_merge(config, tmp_path / "pending", progress=False)
        assert (tmp_path / "pending" / "model.safetensors").read_bytes() == on.read_bytes()


def test_outputs_are_recycled_only_once_no_tensor_refers_to_them(monkeypatch):
    """Within ``_memory.recycling()``: a dropped output's mapping serves the next output of its
    size; a live one (or one a view keeps) is never handed out again; a new size releases the
    free mappings of other sizes; outside the block nothing is reused."""
    monkeypatch.setattr(_memory, "HUGE_FROM", 4096)
    like = torch.zeros(1)
    with _memory.recycling():
        a = _memory.empty((2048,), like=like).fill_(1.0)
        address = a.data_ptr()
        view = a[5:]
        del a
        b = _memory.empty((2048,), like=like).fill_(2.0)  # a's mapping is still held by view
        assert b.data_ptr() != address and float(view.sum()) == 2043.0
        del view
        c = _memory.empty((2048,), like=like)
        assert c.data_ptr() == address  # reused
        del b, c
        pool = _memory._pool.get()
        assert pool is not None and len(pool) == 2
        d = _memory.empty((1024, 3), like=like)  # a new size: the two free mappings go
        assert len(pool) == 1 and d.shape == (1024, 3)
    e = _memory.empty((2048,), like=like)
    del e
    f = _memory.empty((2048,), like=like)
    assert _memory._pool.get() is None and f.shape == (2048,)


def test_fresh_outputs_are_ordinary_tensors():
    like = torch.zeros(1, dtype=torch.float64)
    small = _memory.empty((3, 4), like=like)
    assert small.shape == (3, 4) and small.dtype == torch.float64
    large = _memory.empty((1024, 2048), like=like)  # 16 MiB: mapped with huge pages
    assert large.shape == (1024, 2048) and large.dtype == torch.float64 and large.is_contiguous()
    large.fill_(2.0)
    view = large[7]
    del large  # the view keeps the mapping alive
    assert float(view.sum()) == 2.0 * 2048


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("offset", [0, 1, 3, 15])
def test_streaming_stores_give_the_chunked_bits_at_any_alignment(monkeypatch, dtype, offset):
    """From ``STREAM_MIN_NUMEL`` elements the C loop writes whole blocks with non-temporal
    stores: an output not aligned to a cache line (``offset`` elements in), whole blocks and a
    tail give the chunked result, nothing is written outside the output, a negative h is
    still counted."""
    monkeypatch.setattr(_native, "STREAM_MIN_NUMEL", 256)
    _native._function.cache_clear()  # the threshold is in the C source
    try:
        gen = torch.Generator().manual_seed(offset)
        n = 256 + 3 * 64 + 37
        b, f0, f1 = (torch.randn(n, generator=gen, dtype=dtype) for _ in range(3))
        h1 = torch.rand(n, generator=gen, dtype=dtype)
        alphas, h = [0.7, 1.3], [0.1, h1, 0.3]
        consts, _ = _native._constants(alphas, h)
        try:
            function = _native._function("dhd", _native.DTYPES[dtype])
        except (RuntimeError, OSError) as err:
            pytest.skip(f"no C loop here: {err}")
        buffer = torch.full((n + offset + 5,), float("nan"), dtype=dtype)
        out = buffer[offset : offset + n]
        arrays = (ctypes.c_double * len(consts))(*consts)
        ptrs = [x.data_ptr() for x in (out, b, f0, f1, h1)]
        chunked = gm.gradient_matching(
            {"w": b},
            [{"w": f0}, {"w": f1}],
            [gm.Diagonal({"w": h1}), 0.3],
            prior=0.1,
            alphas=alphas,
            kernel=None,
        )["w"]
        assert function(n, arrays, *ptrs) == 0
        assert torch.equal(out, chunked)
        assert buffer[:offset].isnan().all() and buffer[offset + n :].isnan().all()
        h1[n - 1] = -1.0  # in the tail
        h1[300] = -1.0  # in a streamed block
        assert function(n, arrays, *ptrs) == 2
    finally:
        _native._function.cache_clear()


@pytest.mark.usefixtures("compiled")
def test_compiled_kernel_matches_the_closed_form_of_eq6():
    """Independent reference: θ = θ_LLM + Σ_t α_t (δ + h_t) τ_t / (δ + Σ_t α_t h_t), evaluated in
    float64 from the float32 inputs; the float32 kernel agrees to a few ulp of float32."""
    gen = torch.Generator().manual_seed(6)
    base, fts, hs = _params(gen), [_params(gen), _params(gen)], [_diag(gen), _diag(gen)]
    alphas, delta = [0.7, 1.3], 0.25
    merged = gm.gradient_matching(base, fts, hs, prior=delta, alphas=alphas, kernel=KERNELS["on"])
    for k, b in base.items():
        b64 = b.double()
        num = sum(
            a * (delta + h.values[k].double()) * (ft[k].double() - b64)
            for a, ft, h in zip(alphas, fts, hs, strict=True)
        )
        den = delta + sum(a * h.values[k].double() for a, h in zip(alphas, hs, strict=True))
        torch.testing.assert_close(merged[k].double(), b64 + num / den, rtol=1e-6, atol=1e-6)


def test_auto_takes_the_c_loop_for_cpu_floats_from_its_threshold(monkeypatch):
    monkeypatch.delenv(_fused.ENV, raising=False)
    f32, f64 = torch.zeros(_native.MIN_NUMEL), torch.zeros(_native.MIN_NUMEL, dtype=torch.float64)
    assert _fused.takes(f32, [f32], large_call=False)  # no compile to amortise
    assert _fused.takes(f64, [f64, f64], large_call=False)
    assert not _fused.takes(f32[:-1], [f32[:-1]], large_call=False)
    assert not _fused.takes(f32, [f64], large_call=False)  # mixed dtypes: the chunked path
    half = f32.to(torch.bfloat16)
    assert not _fused.takes(half, [half], large_call=False)  # other dtypes: inductor, if large
    assert select([f32.numel()]) is not None  # "auto": the engine takes the C loop
    with gm.fused_kernels("off"):
        assert select([f32.numel()]) is None  # "off": the engine takes no kernel


def test_strided_inputs_give_the_chunked_result():
    gen = torch.Generator().manual_seed(7)
    base = {"w": torch.randn(80, 71, generator=gen).t()}  # not contiguous
    fts = [{"w": torch.randn(71, 80, generator=gen)}, {"w": torch.randn(71, 80, generator=gen)}]
    hs = [gm.Diagonal({"w": torch.rand(80, 71, generator=gen).t()}), 0.5]
    fused, chunked = _both(
        lambda kernel: gm.gradient_matching(base, fts, hs, prior=0.2, kernel=kernel)
    )
    assert fused["w"].shape == (71, 80)
    assert torch.equal(fused["w"], chunked["w"])


def test_c_loops_are_cached_only_in_a_private_folder(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    (shared / "kernels").mkdir(parents=True)
    (shared / "kernels").chmod(0o777)
    monkeypatch.setenv(_native.CACHE_ENV, str(shared))
    _native._cache_dir.cache_clear()
    try:
        folder = _native._cache_dir()
        assert folder != shared / "kernels"  # group/world-writable: not trusted
        assert not folder.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        monkeypatch.setenv(_native.CACHE_ENV, str(tmp_path / "mine"))
        _native._cache_dir.cache_clear()
        assert _native._cache_dir() == tmp_path / "mine" / "kernels"
    finally:
        _native._cache_dir.cache_clear()


@pytest.mark.parametrize("threads", [2, 3])
def test_the_c_loop_split_over_threads_gives_the_same_bits(monkeypatch, threads):
    """Tensors split over threads (here from 1024 elements per thread, so 5003 elements make
    two or three uneven parts) give the chunked result, and still catch a negative h."""
    monkeypatch.setattr(_native, "PARALLEL_MIN_NUMEL", 1024)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(8)
        base, fts, hs = _params(gen), [_params(gen), _params(gen)], [_diag(gen), 0.3]
        fused, chunked = _both(
            lambda kernel: gm.gradient_matching(base, fts, hs, prior=0.1, kernel=kernel)
        )
        assert all(torch.equal(fused[k], chunked[k]) for k in base)
        hs[0].values["big"][5002] = -1.0  # in the last part
        h = [0.1, hs[0].values["big"], 0.3]
        assert _native.merge_tensor(base["big"], [ft["big"] for ft in fts], [1.0, 1.0], h) is None
    finally:
        torch.set_num_threads(before)
