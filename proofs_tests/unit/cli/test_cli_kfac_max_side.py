"""`gradmerge curvature --kfac-max-factor-side N|none` (its first name, --kfac-max-side, still
accepted): passed to gm.estimate_curvature, and bad values.

Reference: the library call with the same options (whose diagonal block is checked against
``structure="diag"`` in proofs_tests/estimate/test_kfac_large_layers.py).
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import gradmerge as gm
from gradmerge import cli

ENTRY_POINTS = textwrap.dedent(
    """
    import torch
    from torch import nn

    def lm():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Embedding(50, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 300)
        ).double()
    """
)


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "gm_test_lm.py").write_text(ENTRY_POINTS)
    g = torch.Generator().manual_seed(1)
    ids, targets = (
        torch.randint(0, 50, (5, 3), generator=g),
        torch.randint(0, 300, (5, 3), generator=g),
    )
    torch.save({"inputs": ids, "targets": targets}, tmp_path / "tokens.pt")
    return tmp_path


def _run(workdir, out, *extra: str) -> int:
    model, data = f"{workdir}/gm_test_lm.py:lm", str(workdir / "tokens.pt")
    argv = ["curvature", model, data, str(out), "--structure", "kfac", "--batch-size", "2"]
    return cli.main([*argv, "--fisher", "mc", "--seed", "3", *extra, "--no-progress"])


def _library(kfac_max_factor_side):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 16),
        torch.nn.Linear(16, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 300),
    ).double()
    g = torch.Generator().manual_seed(1)
    ids, targets = (
        torch.randint(0, 50, (5, 3), generator=g),
        torch.randint(0, 300, (5, 3), generator=g),
    )
    batches = [(ids[i : i + 2], targets[i : i + 2]) for i in range(0, 5, 2)]
    curvature = gm.estimate_curvature(
        model,
        batches,
        structure="kfac",
        fisher="mc",
        seed=3,
        kfac_max_factor_side=kfac_max_factor_side,
    )
    return model, curvature


def test_the_flag_routes_the_head_as_the_library_does(workdir):
    out = workdir / "k.safetensors"
    with pytest.warns(UserWarning, match="limit of 100"):
        assert _run(workdir, out, "--kfac-max-side", "100") == 0
        model, ref = _library(100)
    loaded = gm.load_curvature(out, like=model)
    assert isinstance(loaded, gm.Blocks) and isinstance(ref, gm.Blocks)
    assert [type(b) for b in loaded.blocks] == [gm.KFAC, gm.Diagonal]
    assert set(loaded.blocks[1].values) == {"3.weight", "3.bias"}
    v = {k: torch.ones_like(p) for k, p in model.named_parameters()}
    for k, value in ref.mv(v).items():
        torch.testing.assert_close(loaded.mv(v)[k], value, rtol=1e-12, atol=1e-14)
    assert loaded.meta["kfac_max_factor_side"] == "100"
    assert set(json.loads(loaded.meta["kfac_diagonal_layers"])) == {"3"}


def test_none_lifts_the_limit(workdir):
    out = workdir / "k.safetensors"
    assert _run(workdir, out, "--kfac-max-factor-side", "none") == 0
    loaded = gm.load_curvature(out)
    assert isinstance(loaded, gm.KFAC) and set(loaded.terms) == {"0", "1", "3"}
    assert loaded.meta["kfac_max_factor_side"] == "none"
    assert loaded.meta["kfac_diagonal_layers"] == "{}"


def test_the_default_is_the_library_default(workdir):
    out = workdir / "k.safetensors"
    assert _run(workdir, out) == 0
    assert gm.load_curvature(out).meta["kfac_max_factor_side"] == "16384"


@pytest.mark.parametrize("bad", ["0", "-3", "1.5", "lots"])
def test_bad_values_are_argparse_errors(workdir, capsys, bad):
    out = workdir / "k.safetensors"
    with pytest.raises(SystemExit) as exit_info:
        _run(workdir, out, "--kfac-max-side", bad)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--kfac-max-side" in err and "expected a positive integer" in err and "'none'" in err
    assert not out.exists()


def test_the_distributed_estimator_applies_the_same_limit():
    """One gloo rank in this process: gm.distributed.estimate_curvature routes the head exactly as
    the single-process call does (the CLI's --distributed path passes the flag to it)."""
    import torch.distributed as dist

    from gradmerge.distributed import estimate_curvature

    model, single = _library(100)
    g = torch.Generator().manual_seed(1)
    ids, targets = (
        torch.randint(0, 50, (5, 3), generator=g),
        torch.randint(0, 300, (5, 3), generator=g),
    )
    batches = [(ids[i : i + 2], targets[i : i + 2]) for i in range(0, 5, 2)]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        summed = estimate_curvature(
            model, batches, structure="kfac", fisher="mc", seed=3, kfac_max_factor_side=100
        )
        with pytest.raises(gm.distributed.DistributedError, match="kfac_max_factor_side"):
            estimate_curvature(model, batches, structure="kfac", kfac_max_factor_side=0)
    finally:
        dist.destroy_process_group()
    assert summed.meta["kfac_diagonal_layers"] == single.meta["kfac_diagonal_layers"]
    assert "3" in json.loads(summed.meta["kfac_diagonal_layers"])
    v = {
        k: torch.randn(p.shape, generator=g, dtype=torch.float64)
        for k, p in model.named_parameters()
    }
    for k, x in single.mv(v).items():
        torch.testing.assert_close(summed.mv(v)[k], x, rtol=1e-12, atol=0)


def test_help_shows_the_flag_and_an_example(capsys):
    with pytest.raises(SystemExit):
        cli.main(["curvature", "--help"])
    text = capsys.readouterr().out
    assert "--kfac-max-factor-side N" in text and "--kfac-max-factor-side 8192" in text
