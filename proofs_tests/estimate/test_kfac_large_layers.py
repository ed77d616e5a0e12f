"""K-FAC's factor-side limit (``kfac_max_factor_side``): layers whose A or G would be too large
get the diagonal block of the same fisher type instead of Kronecker factors.

References: the routed layer's block is compared with ``structure="diag"`` (the diagonal
estimator run on the whole model), the layers that stay on K-FAC with a run without a limit.
Every comparison is in float64 at rtol 1e-12: the values come from the same computation, only
the grouping of the batched backward passes may differ.

Monte-Carlo Fisher: the diagonal block is estimated by its own pass over the data with a fresh
``torch.Generator().manual_seed(seed)`` drawing, batch by batch, the same ``mc_samples`` targets
per example as ``structure="diag"`` does (and as K-FAC's own pass does), so with the same seed the
draws, and the values, are the same as well.

GGN: K-FAC backpropagates one vector per output class and refuses more than 256 classes
(``max_ggn_columns``), so the GGN case uses a 200-class head (still above the limit of 100).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import gradmerge as gm
from gradmerge.estimate import MAX_FACTOR_SIDE, estimate_kfac_factors

DT = torch.float64
TIGHT = {"rtol": 1e-12, "atol": 1e-14}


def _lm(classes: int = 300) -> nn.Module:
    """Embedding(50, 16) → Linear(16, 16) → ReLU → Linear(16, classes), the "head"."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(50, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, classes)
    ).to(DT)


def _tokens(classes: int = 300) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two batches of (4, 3) token ids and per-position targets, two of them ignored."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        ids = torch.randint(0, 50, (4, 3), generator=g)
        targets = torch.randint(0, classes, (4, 3), generator=g)
        targets[0, 2] = -100
        out.append((ids, targets))
    return out


def _blocks(c: gm.Curvature) -> tuple[gm.KFAC, gm.Diagonal]:
    assert isinstance(c, gm.Blocks) and len(c.blocks) == 2
    kfac, diagonal = c.blocks
    assert isinstance(kfac, gm.KFAC) and isinstance(diagonal, gm.Diagonal)
    return kfac, diagonal


def _trainable(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.named_parameters() if v.requires_grad}


@pytest.mark.parametrize(("fisher", "classes"), [("empirical", 300), ("mc", 300), ("ggn", 200)])
def test_a_head_above_the_limit_gets_the_diagonal_estimate(fisher: str, classes: int) -> None:
    model, data = _lm(classes), _tokens(classes)
    options = {"fisher": fisher, "seed": 7, **({"mc_samples": 2} if fisher == "mc" else {})}
    with pytest.warns(UserWarning, match=rf"'3' \(G: {classes} × {classes}, .* limit of 100"):
        limited = gm.estimate_curvature(
            model, data, structure="kfac", kfac_max_factor_side=100, **options
        )
    unlimited = gm.estimate_curvature(
        model, data, structure="kfac", kfac_max_factor_side=None, **options
    )
    diag = gm.estimate_curvature(model, data, structure="diag", **options)

    kfac, diagonal = _blocks(limited)
    assert set(kfac.terms) == {"0", "1"} and set(diagonal.values) == {"3.weight", "3.bias"}
    for name in ("3.weight", "3.bias"):  # the head: exactly what structure="diag" gives it
        assert diagonal.values[name].abs().max() > 0
        torch.testing.assert_close(diagonal.values[name], diag.values[name], **TIGHT)
    assert isinstance(unlimited, gm.KFAC) and set(unlimited.terms) == {"0", "1", "3"}
    for module in ("0", "1"):  # the small layers keep the factors of the unlimited run
        (a, g), (a_ref, g_ref) = kfac.terms[module][0], unlimited.terms[module][0]
        torch.testing.assert_close(a, a_ref, **TIGHT)
        torch.testing.assert_close(g, g_ref, **TIGHT)
    assert {k: tuple(s) for k, s in limited.layout} == _trainable(model)  # every parameter once

    assert limited.meta["kfac_max_factor_side"] == "100"
    routed = json.loads(limited.meta["kfac_diagonal_layers"])
    assert routed == {
        "3": f"G would be {classes} × {classes}: a factor side above the limit of 100"
    }
    assert unlimited.meta["kfac_max_factor_side"] == "none"
    assert json.loads(unlimited.meta["kfac_diagonal_layers"]) == {}
    assert limited.meta["num_examples"] == unlimited.meta["num_examples"] == "8"


def test_the_default_limit_is_silent_for_small_models() -> None:
    model, data = _lm(), _tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = gm.estimate_curvature(model, data, structure="kfac")
    assert isinstance(c, gm.KFAC) and set(c.terms) == {"0", "1", "3"}
    assert c.meta["kfac_max_factor_side"] == str(MAX_FACTOR_SIDE) == "16384"
    assert c.meta["kfac_diagonal_layers"] == "{}"


def test_a_side_and_boundary() -> None:
    """A counts the bias column; a side equal to the limit is kept."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    data = [(torch.randn(5, 100, dtype=DT), torch.randint(0, 3, (5,)))]
    with pytest.warns(UserWarning, match=r"'0' \(A: 101 × 101"):
        kf = estimate_kfac_factors(model, data, max_factor_side=100)
    assert set(kf.factors) == {"2"} and kf.uncovered == ["0.weight", "0.bias"]
    assert kf.left_out == {"0": "A would be 101 × 101: a factor side above the limit of 100"}
    assert kf.max_factor_side == 100

    model[0].bias = None  # A of side 100 = the limit: K-FAC
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kf = estimate_kfac_factors(model, data, max_factor_side=100)
    assert set(kf.factors) == {"0", "2"} and kf.left_out == {}


def test_an_embedding_is_held_to_the_limit_by_its_vocabulary() -> None:
    """Its A is stored dense in gm.KFAC: a 50-row vocabulary above a limit of 40 goes diagonal
    (after estimation: its A is only a vector there)."""
    model, data = _lm(), _tokens()
    diag = gm.estimate_curvature(model, data, structure="diag")
    with pytest.warns(UserWarning, match=r"'3' \(G: 300"):  # only the head is routed early
        c = gm.estimate_curvature(model, data, structure="kfac", kfac_max_factor_side=40)
    kfac, diagonal = _blocks(c)
    assert set(kfac.terms) == {"1"} and set(diagonal.values) == {"0.weight", "3.weight", "3.bias"}
    torch.testing.assert_close(diagonal.values["0.weight"], diag.values["0.weight"], **TIGHT)
    routed = json.loads(c.meta["kfac_diagonal_layers"])
    assert set(routed) == {"0", "3"} and routed["0"].startswith("embedding of 50 rows")


def test_every_layer_above_the_limit_gives_the_diagonal_estimate() -> None:
    model, data = _lm(), _tokens()
    with pytest.warns(UserWarning, match=r"'0' \(G: 16 × 16.*'1' \(A: 17 × 17.*'3' \(G: 300"):
        c = gm.estimate_curvature(model, data, structure="kfac", kfac_max_factor_side=15)
    diag = gm.estimate_curvature(model, data, structure="diag")
    assert isinstance(c, gm.Diagonal) and set(c.values) == set(_trainable(model))
    for name, value in diag.values.items():
        torch.testing.assert_close(c.values[name], value, **TIGHT)
    routed = json.loads(c.meta["kfac_diagonal_layers"])
    assert set(routed) == {"0", "1", "3"} and c.meta["num_examples"] == "8"
    assert (
        routed["1"]
        == "G would be 16 × 16 and A would be 17 × 17: a factor side above the limit of 15"
    )


def test_a_tied_weight_is_recorded() -> None:
    """Shared weights were already left to the diagonal; the routing now says so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 7))
    model[3].weight = model[0].weight
    data = [(torch.randint(0, 7, (3, 2)), torch.randint(0, 7, (3, 2)))]
    c = gm.estimate_curvature(model, data, structure="kfac")
    routed = json.loads(c.meta["kfac_diagonal_layers"])
    assert routed == {
        "0": "its weight is shared with ['3'] (tied)",
        "3": "its weight is shared with ['0'] (tied)",
    }


def test_progress_names_the_routed_layer(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.warns(UserWarning):
        gm.estimate_curvature(
            _lm(), _tokens(), structure="kfac", kfac_max_factor_side=100, progress=True
        )
    assert "kfac: '3' gets no factors: G would be 300 × 300" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [0, -5, 2.5, "100", True])
def test_bad_limits_are_argument_errors(bad: object) -> None:
    model, data = _lm(), _tokens()
    with pytest.raises(gm.ArgumentError, match="kfac_max_factor_side must be a positive int"):
        gm.estimate_curvature(model, data, structure="kfac", kfac_max_factor_side=bad)  # type: ignore[arg-type]
    with pytest.raises(gm.ArgumentError, match="max_factor_side must be a positive int"):
        estimate_kfac_factors(model, data, max_factor_side=bad)  # type: ignore[arg-type]


def test_a_mixed_curvature_survives_save_and_load(tmp_path) -> None:
    model, data = _lm(), _tokens()
    with pytest.warns(UserWarning):
        c = gm.estimate_curvature(
            model, data, structure="kfac", fisher="mc", kfac_max_factor_side=100
        )
    path = c.save(tmp_path / "mixed.safetensors")
    loaded = gm.load_curvature(path, like=model)
    kfac, diagonal = _blocks(loaded)
    kfac_ref, diagonal_ref = _blocks(c)
    for module, terms in kfac_ref.terms.items():
        for (a, g), (a_ref, g_ref) in zip(kfac.terms[module], terms, strict=True):
            assert torch.equal(a, a_ref) and torch.equal(g, g_ref)
    assert kfac.transposed == kfac_ref.transposed and kfac.bias == kfac_ref.bias
    for name, value in diagonal_ref.values.items():
        assert torch.equal(diagonal.values[name], value)
    g = torch.Generator().manual_seed(2)
    v = {k: torch.randn(s, generator=g, dtype=DT) for k, s in _trainable(model).items()}
    for k, value in c.mv(v).items():
        torch.testing.assert_close(loaded.mv(v)[k], value, **TIGHT)  # same factors, own order
    for key in ("kfac_max_factor_side", "kfac_diagonal_layers", "structure", "fisher"):
        assert loaded.meta[key] == c.meta[key]
    assert json.loads(loaded.meta["kfac_diagonal_layers"]) == {
        "3": "G would be 300 × 300: a factor side above the limit of 100"
    }
