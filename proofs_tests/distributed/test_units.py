"""The parts of gm.distributed that need no second process: sharding, seeds, fingerprints, the
reduction arithmetic (two ranks simulated in one process) and one-rank process groups."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradmerge as gm
from gradmerge.distributed import (
    DistributedError,
    estimate_curvature,
    model_fingerprint,
    rank_seed,
    shard,
    shard_range,
)
from gradmerge.distributed import comm as comm_module
from gradmerge.distributed.comm import Comm, _buckets
from gradmerge.distributed.estimate import _estimate_local
from gradmerge.distributed.fingerprint import first_difference, unwrap
from gradmerge.distributed.reduce import contributions, rebuild
from gradmerge.errors import ArgumentError
from proofs_tests.distributed import cases


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process (no port: an in-memory store)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ----- sharding -----------------------------------------------------------------------------
@pytest.mark.parametrize("n, world", list(itertools.product(range(8), range(1, 5))))
def test_shards_cover_every_item_once_in_order(n, world):
    parts = [list(shard_range(n, rank=r, world_size=world)) for r in range(world)]
    assert [i for p in parts for i in p] == list(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    items = [f"b{i}" for i in range(n)]
    assert [x for r in range(world) for x in shard(items, rank=r, world_size=world)] == items


def test_shard_of_a_sized_iterable_is_re_iterable():
    class Batches:  # sized, iterable, not indexable (like gradmerge curvature's TensorBatches)
        def __len__(self):
            return 5

        def __iter__(self):
            return iter(range(5))

    part = shard(Batches(), rank=1, world_size=2)
    assert list(part) == [2, 3, 4] and list(part) == [2, 3, 4] and len(part) == 3


def test_shard_refuses_what_it_cannot_split():
    with pytest.raises(ArgumentError, match="without len"):
        shard((b for b in range(3)), rank=0, world_size=2)
    with pytest.raises(ArgumentError, match="rank < world_size"):
        shard_range(4, rank=2, world_size=2)
    with pytest.raises(ArgumentError, match="non-negative int"):
        shard_range(-1, rank=0, world_size=1)
    if not dist.is_initialized():
        with pytest.raises(ArgumentError, match="not initialised"):
            shard_range(4)


# ----- seeds ----------------------------------------------------------------------------------
def test_rank_seeds():
    assert rank_seed(123, 0) == 123  # one rank: the single-process draws
    seeds = [rank_seed(123, r) for r in range(256)]
    assert len(set(seeds)) == 256 and all(0 <= s < 2**63 for s in seeds)
    torch.Generator().manual_seed(rank_seed(2**62, 255))  # a valid torch seed
    with pytest.raises(ArgumentError):
        rank_seed(0, -1)


# ----- fingerprints ---------------------------------------------------------------------------
def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).eval()


def test_fingerprint_of_equal_models_agrees():
    assert first_difference(model_fingerprint(_net()), model_fingerprint(_net())) is None


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            lambda m: m[0].weight.data.__setitem__(
                (0, 0), torch.nextafter(m[0].weight.data[0, 0], torch.tensor(9.0))
            ),
            "values of '0.weight'",
        ),
        (
            lambda m: m[0].weight.data.copy_(m[0].weight.data.flip(1)),
            "values of '0.weight'",
        ),  # same numbers, permuted
        (lambda m: m[1].running_mean.add_(1e-3), "values of '1.running_mean'"),  # a buffer
        (lambda m: m[2].bias.requires_grad_(False), "requires_grad of '2.bias'"),
        (lambda m: m.double(), "dtypes of '0.weight'"),
        (lambda m: m.train(), "training mode"),
        (lambda m: m.append(nn.Linear(2, 2)), "names differ"),
    ],
)
def test_fingerprint_notices_each_kind_of_difference(change, expected):
    other = _net()
    with torch.no_grad():
        change(other)
    assert expected in first_difference(model_fingerprint(_net()), model_fingerprint(other))


def test_unwrap_strips_data_parallel_wrappers():
    net = _net()
    assert unwrap(nn.DataParallel(net)) is net
    with pytest.raises(ArgumentError, match=r"nn\.Module"):
        unwrap({"weight": torch.ones(1)})


# ----- the reduction arithmetic, two ranks simulated in this process -------------------------
SIMULATED = [
    ("diag", "empirical", "expand"),
    ("full", "ggn", "expand"),
    ("kfac", "empirical", "expand"),
    ("kfac", "ggn", "reduce"),
]


@pytest.mark.parametrize("structure, fisher, approx", SIMULATED)
def test_summed_contributions_equal_the_estimate_on_all_the_data(structure, fisher, approx):
    """What all_reduce would do, by hand: Σ_r contributions_r, rebuilt, against all the data."""
    model, data = cases.lm_model(), cases.lm_batches()
    options = gm.EstimateOptions(structure=structure, fisher=fisher, kfac_approx=approx)
    local = [
        _estimate_local(model, shard(data, rank=r, world_size=2), options, rank=r) for r in range(2)
    ]
    parts = [contributions(x.curvature, counts=x.counts, diagonal_a=x.diagonal_a) for x in local]
    assert list(parts[0]) == list(parts[1])
    summed = {k: parts[0][k] + parts[1][k] for k in parts[0]}
    counts = {m: local[0].counts[m] + local[1].counts[m] for m in local[0].counts}
    result = rebuild(local[0].curvature, summed, counts=counts, diagonal_a=local[0].diagonal_a)
    reference = gm.estimate_curvature(
        model, data, structure=structure, fisher=fisher, kfac_approx=approx
    )
    assert type(result) is type(reference) and result.layout == reference.layout
    ref = reference.dense()
    torch.testing.assert_close(result.dense(), ref, rtol=1e-12, atol=1e-13 * float(ref.abs().max()))
    if structure == "kfac":
        assert local[0].diagonal_a == {"tok"}  # the embedding's A travels as its diagonal
        assert parts[0]["blocks0/kfac/tok/0/A"].ndim == 1


def test_a_rank_without_kept_positions_contributes_nothing():
    """All of rank 1's targets ignored: M_1 = 0, A_1 = 0, and the sum is rank 0's estimate."""
    model, data = cases.lm_model(), cases.lm_batches()
    ignored = [(x, torch.full_like(y, -100)) for x, y in data[1:]]
    options = gm.EstimateOptions(structure="kfac")
    local = [_estimate_local(model, d, options, rank=r) for r, d in enumerate((data[:1], ignored))]
    assert all(c == 0 for c in local[1].counts.values())
    parts = [contributions(x.curvature, counts=x.counts, diagonal_a=x.diagonal_a) for x in local]
    summed = {k: parts[0][k] + parts[1][k] for k in parts[0]}
    counts = {m: local[0].counts[m] + local[1].counts[m] for m in local[0].counts}
    result = rebuild(local[0].curvature, summed, counts=counts, diagonal_a=local[0].diagonal_a)
    reference = gm.estimate_curvature(model, data[:1] + ignored, structure="kfac")
    torch.testing.assert_close(result.dense(), reference.dense(), rtol=1e-12, atol=1e-14)


# ----- one-rank process groups -----------------------------------------------------------------
def test_without_a_process_group_the_error_says_how_to_start_one():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(ArgumentError, match="torchrun"):
        estimate_curvature(cases.mlp_model(), cases.mlp_batches(), loss="mse")


def test_one_rank_mc_kfac_is_the_single_process_estimate(one_rank_group):
    model, data = cases.lm_model(), cases.lm_batches()
    options = {"structure": "kfac", "fisher": "mc", "mc_samples": 2, "seed": 7}
    C = estimate_curvature(model, data, timeout=30, **options)
    reference = gm.estimate_curvature(model, data, **options)
    torch.testing.assert_close(C.dense(), reference.dense(), rtol=1e-12, atol=1e-14)
    assert C.meta == {**reference.meta, "ranks": "1"}


def test_one_rank_failure_is_a_distributed_error_with_its_cause(one_rank_group):
    data = cases.mlp_batches_nan_last()
    with pytest.raises(DistributedError, match="rank 0: NonFiniteError") as info:
        estimate_curvature(cases.mlp_model(), data, loss="mse", timeout=30)
    assert isinstance(info.value.__cause__, gm.NonFiniteError)
    assert set(info.value.failures) == {0}
    with pytest.raises(DistributedError, match="rank 0: ArgumentError: params="):
        estimate_curvature(
            cases.mlp_model(), data, loss="mse", structure="kfac", params=["0.weight"]
        )


def test_all_reduce_packs_buckets_and_keeps_shapes(one_rank_group, monkeypatch):
    monkeypatch.setattr(comm_module, "BUCKET_BYTES", 8 * 10)  # ten float64 per bucket
    tensors = [
        torch.randn(2, 3, dtype=torch.float64),
        torch.randn(3, dtype=torch.float64),
        torch.randn(4, 5, dtype=torch.float64).T,
        torch.randn(7),
        torch.randn(30, dtype=torch.float64),
    ]
    before = [t.clone() for t in tensors]
    with Comm.open(None, timeout=30) as comm:
        comm.all_reduce(tensors)
    for t, b in zip(tensors, before, strict=True):
        assert t.shape == b.shape and torch.equal(t, b)  # one rank: the sum is the tensor
    assert [
        len(b)
        for b in _buckets([torch.zeros(4), torch.zeros(4), torch.zeros(20), torch.zeros(1)], 10)
    ] == [2, 1, 1]


# ----- distributed merging: the split, the names, one rank ------------------------------------
def _plan(sizes):
    from gradmerge.jobs.plan import Plan, Unit

    units = tuple(Unit((f"t{i}",), True) for i in range(len(sizes)))
    return Plan(
        units,
        {f"t{i}": (n,) for i, n in enumerate(sizes)},
        {f"t{i}": torch.float32 for i in range(len(sizes))},
    )


@pytest.mark.parametrize("sizes", [[1] * 10, [5, 1, 1, 1, 9, 2, 3], [100], [3, 3]])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_units_are_split_in_contiguous_byte_balanced_blocks(sizes, world):
    from gradmerge.distributed.merge import assign_units

    plan = _plan(sizes)
    blocks = assign_units(plan, world)
    assert len(blocks) == world
    assert [u for b in blocks for u in b] == list(plan.units)  # every unit once, in order
    loads = [sum(4 * plan.shapes[k][0] for u in b for k in u.keys) for b in blocks]
    ideal = 4 * sum(sizes) / world
    assert all(abs(load - ideal) <= 4 * max(sizes) for load in loads)


def test_shard_names_follow_rank_order_and_the_hugging_face_layout():
    from gradmerge.distributed.merge import shard_names

    assert shard_names([1]) == [["model.safetensors"]]
    assert shard_names([0, 1]) == [[], ["model.safetensors"]]
    assert shard_names([2, 0, 1]) == [
        ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"],
        [],
        ["model-00003-of-00003.safetensors"],
    ]


def test_one_rank_merge_writes_the_single_process_files(one_rank_group, tmp_path):
    """With one rank, every shard and the index are byte-identical to run_merge's."""
    import filecmp

    from gradmerge.distributed.merge import run_merge as run_merge_distributed
    from gradmerge.jobs import run_merge
    from proofs_tests.workspace import make_workspace

    ws = make_workspace(tmp_path / "ws", "diag")
    _, config = cases.merge_config(str(ws.root), "merge_ta")
    single = run_merge(config, tmp_path / "single", progress=False)
    report = run_merge_distributed(config, tmp_path / "dist", timeout=30)
    names = sorted(p.name for p in single.files)
    assert sorted(p.name for p in report.files) == names and len(names) > 3
    for name in names:
        if name != "gradmerge_merge.json":  # the record holds times and the split
            assert filecmp.cmp(tmp_path / "single" / name, tmp_path / "dist" / name, shallow=False)
    assert (report.tensors, report.units, report.bytes_written) == (
        single.tensors,
        single.units,
        single.bytes_written,
    )
