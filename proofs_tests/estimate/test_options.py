"""gm.EstimateOptions: the estimator's options, checked once and used by every front end.

- every bad option is refused on construction with one typed error and one message, and
  ``gm.estimate_curvature`` and ``gm.distributed.estimate_curvature`` refuse it with that message;
- ``gm.estimate_curvature``'s keywords are the options' fields (names, order, defaults);
- the options give the estimate the keyword call gives (diag, kfac, full), enum or string;
- the strings recorded in ``C.meta`` and in the saved file stay plain strings;
- ``max_factor_side`` stays an alias of ``kfac_max_factor_side`` in ``estimate_kfac_factors``.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

import gradmerge as gm
from gradmerge.estimate import estimate_kfac_factors, estimate_with
from gradmerge.estimate.options import (
    EstimateKeywords,
    EstimateOptions,
    Fisher,
    KFACApprox,
    LossFunction,
    Structure,
)

DT = torch.float64

BAD = [
    ({"structure": "dense"}, "structure must be 'diag', 'kfac' or 'full', got 'dense'"),
    ({"structure": None}, "structure must be 'diag', 'kfac' or 'full', got None"),
    (
        {"fisher": "kfac"},
        "fisher must be 'empirical', 'mc', 'ggn' or 'hessian', got 'kfac'",
    ),
    (
        {"fisher": "hessian"},
        "fisher='hessian' is available for structure='full' (and gm.MatrixFree) only",
    ),
    (
        {"structure": "kfac", "fisher": "hessian"},
        "fisher='hessian' is available for structure='full' (and gm.MatrixFree) only",
    ),
    ({"loss": "hinge"}, "loss must be 'cross_entropy' or 'mse', got 'hinge'"),
    ({"kfac_approx": "both"}, "kfac_approx must be 'expand' or 'reduce', got 'both'"),
    ({"mc_samples": 0, "fisher": "mc"}, "mc_samples must be a positive int"),
    ({"mc_samples": 1.5, "fisher": "mc"}, "mc_samples must be a positive int"),
    ({"mc_samples": True, "fisher": "mc"}, "mc_samples must be a positive int"),
    (
        {"structure": "kfac", "mc_samples": 2},
        "mc_samples=2 only applies to fisher='mc'",
    ),
    ({"kfac_max_factor_side": 0}, "kfac_max_factor_side must be a positive int"),
    ({"kfac_max_factor_side": 2.5}, "kfac_max_factor_side must be a positive int"),
    ({"kfac_max_factor_side": True}, "kfac_max_factor_side must be a positive int"),
    ({"params": "weight"}, "params must be a list of parameter names, got 'weight'"),
    ({"params": [0]}, "params must be a list of parameter names, got [0]"),
    (
        {"structure": "kfac", "params": ["weight"]},
        "params= restricts 'diag' and 'full' estimates; K-FAC covers the model",
    ),
    ({"seed": 1.0}, "seed must be an int, got 1.0"),
    ({"ignore_index": "pad"}, "ignore_index must be an int, got 'pad'"),
    ({"max_params": 0}, "max_params must be a positive int, got 0"),
    ({"progress": "yes"}, "progress must be True or False, got 'yes'"),
]


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    x, y = torch.randn(6, 3, dtype=DT), torch.randint(0, 3, (6,))
    return model, [(x[:4], y[:4]), (x[4:], y[4:])]


@pytest.mark.parametrize(("options", "message"), BAD)
def test_a_bad_option_is_refused_when_the_options_are_made(options, message):
    with pytest.raises(gm.ArgumentError) as err:
        EstimateOptions(**options)
    assert message in str(err.value)


@pytest.mark.parametrize(("options", "message"), BAD)
def test_the_keyword_call_refuses_it_alike_before_reading_data(options, message):
    def data():  # would fail if the estimator got as far as the data
        raise AssertionError("the data was read")
        yield

    model, _ = _mlp()
    with pytest.raises(gm.ArgumentError) as err:
        gm.estimate_curvature(model, data(), **options)
    assert message in str(err.value)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("options", "message"), BAD[::3])
def test_the_distributed_path_refuses_it_with_the_same_message(one_rank, options, message):
    model, data = _mlp()
    with pytest.raises(gm.distributed.DistributedError) as err:
        gm.distributed.estimate_curvature(model, data, **options)
    assert f"ArgumentError: {message}" in str(err.value)
    with pytest.raises(gm.distributed.DistributedError) as err:  # the same with the object
        gm.distributed.estimate_with(model, data, options)  # type: ignore[arg-type]
    assert f"ArgumentError: {message}" in str(err.value)


def test_the_keywords_of_every_front_end_are_the_options_fields():
    """estimate_curvature maps its keywords to the fields by position: names, order and
    defaults must be the same; EstimateKeywords (the distributed **options) has the same keys."""
    fields = [(f.name, f.default) for f in dataclasses.fields(EstimateOptions)]
    signature = inspect.signature(gm.estimate_curvature).parameters.values()
    keywords = [(p.name, p.default) for p in signature if p.kind is p.KEYWORD_ONLY]
    assert keywords == fields
    assert list(EstimateKeywords.__annotations__) == [name for name, _ in fields]


CASES = [
    {"structure": "diag", "fisher": "empirical"},
    {"structure": "diag", "fisher": "mc", "mc_samples": 2, "seed": 3},
    {"structure": "kfac", "fisher": "ggn", "kfac_approx": "reduce"},
    {"structure": "kfac", "fisher": "empirical", "kfac_max_factor_side": 4},
    {"structure": "full", "fisher": "hessian", "params": ["2.weight"]},
    {"structure": "full", "fisher": "ggn", "loss": "cross_entropy"},
]


@pytest.mark.parametrize("keywords", CASES)
def test_the_options_give_the_keyword_calls_estimate(keywords):
    model, data = _mlp()
    reference = gm.estimate_curvature(model, data, **keywords)
    enums = {
        "structure": Structure,
        "fisher": Fisher,
        "loss": LossFunction,
        "kfac_approx": KFACApprox,
    }
    as_enums = {k: enums[k](v) if k in enums else v for k, v in keywords.items()}
    for options in (EstimateOptions(**keywords), EstimateOptions(**as_enums)):
        got = estimate_with(model, data, options)
        assert type(got) is type(reference) and got.layout == reference.layout
        assert torch.equal(got.dense(), reference.dense())
        assert got.meta == reference.meta
    assert EstimateOptions(**keywords) == EstimateOptions(**as_enums)
    assert hash(EstimateOptions(**keywords)) == hash(EstimateOptions(**as_enums))


def test_a_choice_is_its_string():
    options = EstimateOptions(structure="kfac", fisher=Fisher.MC, mc_samples=2, params=None)
    assert options.structure is Structure.KFAC and options.fisher is Fisher.MC
    assert options.structure == "kfac" and f"{options.fisher}" == str(options.fisher) == "mc"
    assert repr(options.kfac_approx) == "'expand'"
    assert EstimateOptions(params=["a", "b"]).params == ("a", "b")  # frozen: a tuple
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.seed = 1  # type: ignore[misc]


def test_meta_and_file_hold_plain_strings(tmp_path):
    """C.meta and the saved file record the options as before: plain strings."""
    model, data = _mlp()
    c = estimate_with(model, data, EstimateOptions(structure=Structure.KFAC, fisher=Fisher.GGN))
    for key, value in {
        "structure": "kfac",
        "fisher": "ggn",
        "loss": "cross_entropy",
        "kfac_approx": "expand",
        "kfac_max_factor_side": "16384",
    }.items():
        assert type(c.meta[key]) is str and c.meta[key] == value
    path = c.save(tmp_path / "c.safetensors")
    with safe_open(str(path), framework="pt") as f:
        stored = f.metadata()
    assert stored["info.structure"] == "kfac" and stored["info.fisher"] == "ggn"
    assert stored["info.kfac_approx"] == "expand"
    assert gm.load_curvature(path).meta == c.meta


def test_max_factor_side_is_an_alias_of_kfac_max_factor_side():
    model, data = _mlp()
    with pytest.warns(UserWarning, match="a factor side above the limit of 4"):
        by_alias = estimate_kfac_factors(model, data, max_factor_side=4)
    with pytest.warns(UserWarning, match="a factor side above the limit of 4"):
        by_name = estimate_kfac_factors(model, data, kfac_max_factor_side=4)
    assert by_alias.kfac_max_factor_side == by_alias.max_factor_side == 4
    assert by_alias.left_out == by_name.left_out and list(by_alias.factors) == ["0"]
    assert all(torch.equal(by_alias.dense(m), by_name.dense(m)) for m in by_name.factors)
    with pytest.raises(gm.ArgumentError, match="first name of kfac_max_factor_side"):
        estimate_kfac_factors(model, data, max_factor_side=4, kfac_max_factor_side=5)


def test_numpy_integers_count_as_ints():
    options = EstimateOptions(seed=np.int64(3), ignore_index=np.int32(-1), max_params=np.int64(9))
    values = (options.seed, options.ignore_index, options.max_params)
    assert values == (3, -1, 9) and all(type(v) is int for v in values)
