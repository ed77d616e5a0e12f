"""Merge and removal YAML files: strict keys, per-method requirements, paths, sizes."""

from pathlib import Path

import pytest
import yaml

from gradmerge.errors import ConfigError, MissingInputError
from gradmerge.jobs import CurvatureTerm, MergeConfig, ModelInput, RemoveConfig, parse_size


@pytest.fixture
def files(tmp_path):
    for name in (
        "base.safetensors",
        "a.safetensors",
        "a.curv",
        "b.safetensors",
        "b.curv",
        "g.safetensors",
    ):
        (tmp_path / name).write_bytes(b"")
    return tmp_path


def _write(folder, data, name="merge.yaml"):
    path = folder / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


GM = {
    "method": "gradient_matching",
    "base_model": "base.safetensors",
    "models": [
        {"model": "a.safetensors", "curvature": "a.curv", "alpha": 0.5},
        {"model": "b.safetensors", "curvature": "b.curv"},
    ],
    "prior": {"delta": "1e-6", "curvature": "a.curv", "scale": 2},
    "dtype": "bfloat16",
    "device": "cpu",
    "passthrough": ["lm_head.weight"],
    "max_shard_size": "2GiB",
    "scale": 0.5,
}


def test_a_full_merge_config(files):
    cfg = MergeConfig.from_yaml(_write(files, GM))
    assert cfg.method == "gradient_matching" and cfg.base_model == files / "base.safetensors"
    assert cfg.models == (
        ModelInput(files / "a.safetensors", files / "a.curv", 0.5),
        ModelInput(files / "b.safetensors", files / "b.curv", 1.0),
    )
    assert cfg.prior == CurvatureTerm(
        1e-6, files / "a.curv", 2.0
    )  # "1e-6": YAML 1.1 reads a string
    assert cfg.alphas == [0.25, 0.5]
    assert (cfg.dtype, cfg.compute_dtype, cfg.device) == ("bfloat16", "float32", "cpu")
    assert cfg.max_shard_size == 2 * 2**30 and cfg.passthrough == ("lm_head.weight",)
    assert cfg.to_dict()["models"][0] == {
        "model": str(files / "a.safetensors"),
        "curvature": str(files / "a.curv"),
        "alpha": 0.5,
        "scale": 1.0,
    }


def test_paths_are_relative_to_the_yaml_file(files, tmp_path, monkeypatch):
    sub = files / "configs"
    sub.mkdir()
    data = {
        **GM,
        "base_model": "../base.safetensors",
        "models": [{"model": "../a.safetensors", "curvature": "../a.curv"}],
    }
    data["prior"] = {"delta": 1.0}
    monkeypatch.chdir(tmp_path.parent)
    cfg = MergeConfig.from_yaml(_write(sub, data))
    assert cfg.base_model.resolve() == (files / "base.safetensors").resolve()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"merge_method": "task_arithmetic"}, r"unknown key 'merge_method'.*did you mean 'method'"),
        ({"priors": {}}, r"unknown key 'priors'.*did you mean 'prior'"),
        (
            {"models": [{"model": "a.safetensors", "curvature": "a.curv", "weight": 1}]},
            r"'weight' in models\[0\].*did you mean 'alpha'",
        ),
        ({"prior": {"delta": 1.0, "sigma": 2}}, r"unknown key 'sigma' in prior"),
        ({"method": "ties"}, r"`method` must be one of task_arithmetic, fisher_average"),
        ({"dtype": "int8"}, r"`dtype` must be one of float32"),
        ({"device": "tpu"}, r"`device` must be auto, cpu, cuda or cuda:N"),
        ({"scale": "big"}, r"`scale` must be a finite number, got 'big'"),
        ({"prior": {"delta": -1.0}}, r"`prior.delta` must be ≥ 0"),
        ({"prior": {"delta": 0.0}}, r"prior is zero: give `delta` > 0"),
        ({"prior": None}, r"needs `prior`, e.g. `prior: \{delta: 1.0e-6\}`"),
        ({"models": []}, r"`models` must be a non-empty list"),
        ({"models": [{"model": "a.safetensors"}]}, r"models\[0\] needs `curvature`"),
        ({"max_shard_size": "lots"}, r"`max_shard_size`: expected a size such as '5GB'"),
        ({"passthrough": "lm_head"}, r"`passthrough` must be a list"),
        ({"allow_mixed_dtypes": "yes"}, r"must be true or false"),
        ({"damping": 1.0}, r"`damping` is not used by method gradient_matching"),
    ],
)
def test_bad_merge_configs_name_the_key(files, change, message):
    data = {**GM, **change}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        MergeConfig.from_yaml(_write(files, data))


def test_missing_files_name_the_key(files):
    data = {**GM, "models": [{"model": "a.safetensors", "curvature": "nope.curv"}]}
    with pytest.raises(MissingInputError, match=r"`models\[0\].curvature`: no file at .*nope.curv"):
        MergeConfig.from_yaml(_write(files, data))
    with pytest.raises(MissingInputError, match=r"`base_model`: no file or folder"):
        MergeConfig.from_yaml(_write(files, {**GM, "base_model": "missing"}))
    with pytest.raises(MissingInputError, match="no configuration file"):
        MergeConfig.from_yaml(files / "absent.yaml")
    assert isinstance(MissingInputError("x"), FileNotFoundError)


def test_method_specific_keys(files):
    ta = {
        "method": "task_arithmetic",
        "base_model": "base.safetensors",
        "models": [{"model": "a.safetensors"}],
    }
    MergeConfig.from_yaml(_write(files, ta))
    with pytest.raises(
        ConfigError, match=r"`models\[0\].curvature` is not used by method task_arithmetic"
    ):
        MergeConfig.from_yaml(
            _write(files, {**ta, "models": [{"model": "a.safetensors", "curvature": "a.curv"}]})
        )
    with pytest.raises(ConfigError, match="`prior` is not used by method task_arithmetic"):
        MergeConfig.from_yaml(_write(files, {**ta, "prior": {"delta": 1.0}}))
    with pytest.raises(ConfigError, match="needs `base_model`"):
        MergeConfig.from_yaml(_write(files, {k: v for k, v in ta.items() if k != "base_model"}))
    fa = {
        "method": "fisher_average",
        "models": [{"model": "a.safetensors", "curvature": "a.curv"}],
        "damping": 1e-8,
    }
    cfg = MergeConfig.from_yaml(_write(files, fa))
    assert cfg.base_model == files / "a.safetensors" and cfg.damping == 1e-8  # the first model


def test_remove_configs(files):
    eq13 = {
        "method": "remove",
        "base_model": "base.safetensors",
        "model": "a.safetensors",
        "curvature": "a.curv",
        "prior": {"delta": 1e-3},
        "remaining": {"delta": 1e-3, "curvature": "b.curv"},
        "alpha": 0.5,
    }
    cfg = RemoveConfig.from_yaml(_write(files, eq13, "remove.yaml"))
    assert cfg.remaining == CurvatureTerm(1e-3, files / "b.curv", 1.0) and cfg.alpha == 0.5
    kl = {
        "method": "influence_remove",
        "base_model": "base.safetensors",
        "gradient": "g.safetensors",
        "remaining": {"delta": 1.0},
    }
    assert RemoveConfig.from_yaml(_write(files, kl, "kl.yaml")).gradient == files / "g.safetensors"
    with pytest.raises(ConfigError, match="`gradient` is not used by method remove"):
        RemoveConfig.from_yaml(_write(files, {**eq13, "gradient": "g.safetensors"}, "x.yaml"))
    with pytest.raises(ConfigError, match="`model` is not used by method influence_remove"):
        RemoveConfig.from_yaml(_write(files, {**kl, "model": "a.safetensors"}, "x.yaml"))
    with pytest.raises(ConfigError, match="needs `remaining`"):
        RemoveConfig.from_yaml(
            _write(files, {k: v for k, v in kl.items() if k != "remaining"}, "x.yaml")
        )
    with pytest.raises(ConfigError, match="unknown key 'models'"):
        RemoveConfig.from_yaml(_write(files, {**kl, "models": []}, "x.yaml"))


def test_not_yaml_or_not_a_mapping(files):
    with pytest.raises(ConfigError, match="not valid YAML"):
        MergeConfig.from_yaml(_write(files, "method: [unclosed"))
    with pytest.raises(ConfigError, match="must be a mapping"):
        MergeConfig.from_yaml(_write(files, "- a\n- b\n"))


def test_sizes():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1.5kb") == 1500 and parse_size(7) == 7
    for bad in ("0", "-1GB", "5 parsecs", True, 1.5):
        with pytest.raises((ValueError, TypeError)):
            parse_size(bad)


def test_configs_without_files_for_programmatic_use():
    cfg = MergeConfig.from_dict(
        {
            "method": "task_arithmetic",
            "base_model": "/nowhere/base",
            "models": [{"model": "/nowhere/a"}],
        },
        check_files=False,
    )
    assert cfg.base_model == Path("/nowhere/base")
