"""A large tensor merged elementwise is read, merged and written a block of rows at a time, with
the same bytes as the whole-tensor merge; anything that couples entries is never split.

The engine splits a tensor larger than ``ROW_BLOCK_BYTES`` (in the compute dtype) when its
method is elementwise on it (task arithmetic; Fisher averaging and gradient matching with
diagonal or δ·I curvatures), so that a bfloat16 embedding is never converted to float32 whole.
Here the threshold is lowered to a few rows, the inputs are bfloat16 (as Hugging Face checkpoints
are), and the output is compared bit for bit with the same merge computed whole and with the
``gm.*`` rule applied in memory to the float32 values (the independent reference).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import gradmerge as gm
from gradmerge.curvature.io import open_curvature
from gradmerge.foundation.readahead import Readahead, data_offsets, row_range
from gradmerge.io.writer import ShardedWriter
from gradmerge.jobs import MergeConfig, run_merge
from gradmerge.jobs import job as job_module
from gradmerge.jobs.opening import open_job

SHAPES = {"embed.weight": (37, 8), "layer.weight": (5, 3, 4), "norm.weight": (8,), "scalar": ()}
ALPHAS = (0.7, 0.4, 1.1)
BLOCK_ROWS = 4  # rows of 8 float32 values per block: 37 rows → 10 blocks, the last of one row


def _tensors(g: torch.Generator, positive: bool = False) -> dict[str, torch.Tensor]:
    out = {}
    for k, s in SHAPES.items():
        x = torch.randn(s, generator=g)
        out[k] = (x.abs() + 0.1 if positive else x).to(torch.bfloat16)
    return out


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("rows")
    g = torch.Generator().manual_seed(3)
    save_file(_tensors(g), root / "base.safetensors")
    for t in range(len(ALPHAS)):
        save_file(_tensors(g), root / f"ft{t}.safetensors")
        gm.Diagonal(_tensors(g, positive=True)).save(root / f"c{t}.safetensors")
    gm.Diagonal(_tensors(g, positive=True)).save(root / "prior.safetensors")
    return root


def _config(method: str) -> dict:
    models = [
        {"model": f"ft{t}.safetensors", "alpha": a}
        | ({"curvature": f"c{t}.safetensors"} if method != "task_arithmetic" else {})
        for t, a in enumerate(ALPHAS)
    ]
    config = {"method": method, "base_model": "base.safetensors", "models": models}
    if method == "gradient_matching":
        config["prior"] = {"delta": 0.5, "curvature": "prior.safetensors", "scale": 2.0}
    if method == "fisher_average":
        config["damping"] = 1e-3
    return config


def _run(ws, method, out, monkeypatch, block_bytes):
    monkeypatch.setattr(job_module, "ROW_BLOCK_BYTES", block_bytes)
    calls = []
    original = ShardedWriter.write_rows

    def spy(self, name, rows, start):
        calls.append((name, start, len(rows)))
        original(self, name, rows, start)

    monkeypatch.setattr(ShardedWriter, "write_rows", spy)
    run_merge(MergeConfig.from_dict(_config(method), root=ws), out, progress=False)
    return load_file(out / "model.safetensors"), calls


def _in_memory(ws, method):
    load = lambda name: {k: v.float() for k, v in load_file(ws / name).items()}  # noqa: E731
    base, fts = load("base.safetensors"), [load(f"ft{t}.safetensors") for t in range(3)]
    if method == "task_arithmetic":
        return gm.task_arithmetic(base, fts, alphas=list(ALPHAS))
    hs = [open_curvature(ws / f"c{t}.safetensors").load(dtype=torch.float32) for t in range(3)]
    if method == "fisher_average":
        return gm.fisher_average(fts, [h + 1e-3 for h in hs], alphas=list(ALPHAS))
    prior = 2.0 * open_curvature(ws / "prior.safetensors").load(dtype=torch.float32) + 0.5
    return gm.gradient_matching(base, fts, hs, prior=prior, alphas=list(ALPHAS))


@pytest.mark.parametrize("method", ["task_arithmetic", "fisher_average", "gradient_matching"])
def test_blocks_of_rows_give_the_whole_merge_bit_for_bit(ws, tmp_path, monkeypatch, method):
    blocked, calls = _run(ws, method, tmp_path / "blocked", monkeypatch, BLOCK_ROWS * 8 * 4)
    whole, none = _run(ws, method, tmp_path / "whole", monkeypatch, 1 << 40)
    assert none == []
    # the tensors above the threshold went in blocks, in order, covering every row once
    for key in ("embed.weight", "layer.weight"):
        per_row = 8 if key == "embed.weight" else 12
        step = max(1, BLOCK_ROWS * 8 // per_row)
        starts = [(s, n) for k, s, n in calls if k == key]
        rows = SHAPES[key][0]
        assert starts == [(s, min(step, rows - s)) for s in range(0, rows, step)]
    assert {k for k, _, _ in calls} == {"embed.weight", "layer.weight"}
    reference = _in_memory(ws, method)
    for k, v in whole.items():
        assert v.dtype == torch.bfloat16
        assert torch.equal(blocked[k].view(torch.int16), v.view(torch.int16)), k
        assert torch.equal(v, reference[k].to(torch.bfloat16)), k


def test_coupled_curvatures_and_other_methods_are_never_split(ws, tmp_path, monkeypatch):
    monkeypatch.setattr(job_module, "ROW_BLOCK_BYTES", 16)
    kfac = gm.Blocks(
        [
            gm.KFAC({"embed": (torch.eye(8), torch.eye(37))}),
            gm.Diagonal({k: torch.ones(s) for k, s in SHAPES.items() if k != "embed.weight"}),
        ]
    )
    kfac.save(tmp_path / "k.safetensors")
    config = _config("gradient_matching")
    config["models"][0]["curvature"] = str(tmp_path / "k.safetensors")
    with open_curvature(tmp_path / "k.safetensors") as f:
        assert not f.elementwise(["embed.weight"]) and f.elementwise(["layer.weight"])
        with pytest.raises(gm.ArgumentError, match="couples their entries"):
            f.restrict(["embed.weight"], rows=slice(0, 2))
    cases = [
        (config, {"embed.weight": False, "layer.weight": True, "norm.weight": True}),
        (_config("gradient_matching"), {"embed.weight": True, "scalar": False}),
        (
            {
                "method": "tsv_merge",
                "base_model": "base.safetensors",
                "models": [{"model": f"ft{t}.safetensors"} for t in range(3)],
            },
            {"embed.weight": False, "norm.weight": False},
        ),
    ]
    from contextlib import ExitStack

    for cfg, expected in cases:
        with ExitStack() as stack:
            job = open_job(MergeConfig.from_dict(cfg, root=ws), stack)
            units = {u.keys[0]: u for u in job.plan.units}
            for key, split in expected.items():
                assert (job.row_blocks(units[key]) != [None]) is split, (cfg["method"], key)


def test_a_singular_block_names_its_rows_and_nothing_is_written(ws, tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(5)
    values = {k: v.float() for k, v in _tensors(g, positive=True).items()}
    values["embed.weight"][30:33] = 0.0  # rows 30–32: no curvature in any task, no damping
    for t in range(3):
        gm.Diagonal(values).save(tmp_path / f"z{t}.safetensors")
    config = _config("fisher_average")
    config.pop("damping")
    for t, m in enumerate(config["models"]):
        m["curvature"] = str(tmp_path / f"z{t}.safetensors")
    monkeypatch.setattr(job_module, "ROW_BLOCK_BYTES", BLOCK_ROWS * 8 * 4)
    with pytest.raises(
        gm.NotPositiveDefiniteError,
        match=r"of 32 entries of 'embed.weight'.*computing \['embed.weight'\] \(rows 28:32\)",
    ):
        run_merge(MergeConfig.from_dict(config, root=ws), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_the_writer_takes_rows_in_order_only(tmp_path):
    w = ShardedWriter(tmp_path, [("a", (3, 2), torch.float32), ("b", (1,), torch.float32)], 100)
    with pytest.raises(gm.ArgumentError, match="from row 1"):
        w.write_rows("a", torch.ones(1, 2), 1)
    with pytest.raises(gm.ArgumentError, match=r"expected 'a' \(3, 2\)"):
        w.write_rows("a", torch.ones(1, 3), 0)
    with pytest.raises(gm.ArgumentError, match=r"expected 'a' \(3, 2\)"):
        w.write_rows("a", torch.ones(4, 2), 0)
    w.write_rows("a", torch.zeros(2, 2), 0)
    with pytest.raises(gm.ArgumentError, match="from row 2 next"):
        w.write("a", torch.ones(3, 2))
    with pytest.raises(gm.ArgumentError, match="not written"):
        w.finish()
    w.write_rows("a", torch.ones(1, 2), 2)
    w.write("b", torch.ones(1))
    assert load_file(w.finish()[0])["a"].tolist() == [[0, 0], [0, 0], [1, 1]]


def test_read_ahead_ranges_are_the_bytes_each_step_reads(ws, tmp_path, monkeypatch):
    """The engine's read-ahead requests name, for every step, exactly the byte ranges of the
    tensors (rows) that step reads from every input (the background thread then gives them as
    posix_fadvise WILLNEED hints: the next test)."""
    path = ws / "c0.safetensors"
    offsets = data_offsets(path)
    raw = path.read_bytes()
    with open_curvature(path) as f:
        values = f.restrict(["embed.weight"], rows=slice(4, 9)).values["embed.weight"]
    start, length = row_range(*offsets["diag/embed.weight"], SHAPES["embed.weight"], slice(4, 9))
    assert raw[start : start + length] == values.contiguous().view(torch.uint8).numpy().tobytes()
    advised: list[tuple[str, int, int]] = []
    real = Readahead.advise

    def record(self, index, offset, length):
        advised.append((os.readlink(f"/proc/self/fd/{self._fds[index]}"), offset, length))
        return real(self, index, offset, length)

    monkeypatch.setattr(Readahead, "advise", record)
    _run(ws, "gradient_matching", tmp_path / "out", monkeypatch, BLOCK_ROWS * 8 * 4)
    inputs = ["base", "ft0", "ft1", "ft2", "c0", "c1", "c2", "prior"]
    expected = []
    for key, shape in SHAPES.items():  # the plan's order is the base's storage order
        blocks: list[slice | None] = [None]
        if math.prod(shape) * 4 > BLOCK_ROWS * 8 * 4:  # split, as in the first test
            step = max(1, BLOCK_ROWS * 8 // math.prod(shape[1:]))
            blocks = [slice(i, min(i + step, shape[0])) for i in range(0, shape[0], step)]
        for rows in blocks:
            for name in inputs:
                tensor = f"diag/{key}" if name[0] in "cp" else key
                begin, end = data_offsets(ws / f"{name}.safetensors")[tensor]
                at, n = row_range(begin, end, shape, rows)
                expected.append((str(ws / f"{name}.safetensors"), at, n))
    assert sorted(advised) == sorted(expected)
