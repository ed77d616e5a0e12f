"""Issue 13, cases 4, 7 and 14: YAML configuration files and what a merge does with them.

4: an alias bomb in a value must give a short error, not format the expanded value; a key given
twice is refused (YAML leaves it to the reader and PyYAML kept the last); a file that is not
UTF-8 is a ConfigError. 7: an output folder that holds the configuration file is refused (with
--overwrite it was deleted with the folder). 14: the same checkpoint listed twice warns.
"""

import resource
import subprocess
import sys

import pytest
import yaml
from safetensors.torch import save_file

import gradmerge as gm
from gradmerge import cli
from gradmerge.errors import ConfigError
from gradmerge.jobs import MergeConfig, RemoveConfig
from proofs_tests.limits import HANG_S


@pytest.fixture
def folder(tmp_path):
    import torch

    for name in ("base", "a", "b"):
        save_file({"w": torch.ones(2)}, tmp_path / f"{name}.safetensors")
    return tmp_path


def _bomb(levels: int, key: str) -> str:
    """YAML whose ``key`` is a list nested ``levels`` deep, 9 aliases of the level below each."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    anchors = "anchors:\n" + "\n".join(f"  {line}" for line in lines)
    return f"{anchors}\n{key}: *l{levels - 1}\n"


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 * 10**9, 3 * 10**9))


# ----- case 4 ------------------------------------------------------------------------------------
BOMB_KEYS = [
    ("method", "must be one of"),
    ("base_model", "must be a path"),
    ("dtype", "must be one of"),
    ("device", "must be auto, cpu"),
    ("scale", "must be a finite number"),
    ("passthrough", "must be a list of names"),
    ("max_shard_size", "expected a size"),
]


@pytest.mark.parametrize(("key", "message"), BOMB_KEYS)
def test_case4_alias_bomb_values_give_a_short_error(folder, key, message):
    # six levels: 9^6 = 531441 leaves, whose repr alone is ~2 MB; the message stays short
    data = yaml.safe_load(_bomb(6, key))
    data.pop("anchors")
    base = {
        "method": "task_arithmetic",
        "base_model": "base.safetensors",
        "models": [{"model": "a.safetensors"}],
    }
    with pytest.raises(ConfigError, match=message) as info:
        MergeConfig.from_dict({**base, key: data[key]}, root=folder)
    assert len(str(info.value)) < 400


def test_case4_nine_level_alias_bomb_is_refused_quickly(folder):
    # 9^9 ≈ 3.9e8 leaves: formatting the expanded value grew memory without bound; a child
    # process (killed after 60 s) stands for the user's shell
    text = (
        "anchors:\n"
        + "\n".join(f"  - &l{i} [{', '.join([f'*l{i - 1}' if i else 'x'] * 9)}]" for i in range(9))
        + "\nmethod: *l8\nbase_model: base.safetensors\nmodels: [{model: a.safetensors}]\n"
    )
    (folder / "bomb.yaml").write_text(text)
    code = (
        "import sys\nfrom gradmerge.jobs import MergeConfig\nfrom gradmerge.errors import ConfigError\n"
        f"try:\n    MergeConfig.from_yaml({str(folder / 'bomb.yaml')!r})\n"
        "except ConfigError as e:\n    print(len(str(e)), str(e)[:200])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=HANG_S,  # a guard against a hang only: the bound under test is memory, not time
        check=True,
        preexec_fn=_limit_memory,  # 3 GB of address space: a regression fails, not the machine
    )
    length, message = done.stdout.split(" ", 1)
    assert int(length) < 400 and message.startswith("`method` must be one of")


def test_case4_duplicate_keys_are_refused(folder):
    text = (
        "method: task_arithmetic\nbase_model: base.safetensors\nbase_model: b.safetensors\n"
        "models: [{model: a.safetensors}]\n"
    )
    (folder / "dup.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"key 'base_model' is given twice.*lines 2 and 3"):
        MergeConfig.from_yaml(folder / "dup.yaml")
    nested = "method: task_arithmetic\nbase_model: base.safetensors\nmodels:\n  - {model: a.safetensors, alpha: 1, alpha: 2}\n"
    (folder / "dup2.yaml").write_text(nested)
    with pytest.raises(ConfigError, match="key 'alpha' is given twice"):
        MergeConfig.from_yaml(folder / "dup2.yaml")


def test_case4_merge_keys_may_still_be_overridden(folder):
    text = (
        "defaults: &d {model: a.safetensors, alpha: 0.5}\n"
        "method: task_arithmetic\nbase_model: base.safetensors\n"
        "models:\n  - {<<: *d, alpha: 0.25}\n"
    )
    data = yaml.safe_load(text)
    data.pop("defaults")
    (folder / "merge_keys.yaml").write_text(yaml.safe_dump(data))
    assert MergeConfig.from_yaml(folder / "merge_keys.yaml").alphas == [0.25]


@pytest.mark.parametrize("raw", [b"method: task_arithm\xe9tic\n", b"\xff\xfe\x00m"])
def test_case4_non_utf8_yaml_is_a_config_error(folder, raw, capsys):
    (folder / "latin1.yaml").write_bytes(raw)
    with pytest.raises(ConfigError, match=r"is not UTF-8 text: byte 0x.. at offset"):
        MergeConfig.from_yaml(folder / "latin1.yaml")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        RemoveConfig.from_yaml(folder / "latin1.yaml")
    assert cli.main(["merge", str(folder / "latin1.yaml"), str(folder / "out")]) == 1
    assert "not UTF-8" in capsys.readouterr().err


# ----- case 7 ------------------------------------------------------------------------------------
def test_case7_output_folder_holding_the_config_is_refused(folder, capsys):
    config = {
        "method": "task_arithmetic",
        "base_model": str(folder / "base.safetensors"),
        "models": [{"model": str(folder / "a.safetensors")}],
    }
    cfgdir = folder / "cfgdir"
    cfgdir.mkdir()
    (cfgdir / "m.yaml").write_text(yaml.safe_dump(config))
    argv = ["merge", str(cfgdir / "m.yaml"), str(cfgdir), "--overwrite", "--no-progress"]
    with pytest.raises(SystemExit) as info:  # the output guard: an argument error, before work
        cli.main(argv)
    assert info.value.code == 2
    assert f"OUT_DIR {cfgdir} contains CONFIG" in capsys.readouterr().err
    assert (cfgdir / "m.yaml").is_file()
    # a parent of the config folder too
    argv = ["merge", str(cfgdir / "m.yaml"), str(folder), "--overwrite", "--no-progress"]
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert (cfgdir / "m.yaml").is_file()
    # another folder is fine
    assert cli.main(["merge", str(cfgdir / "m.yaml"), str(folder / "out"), "--no-progress"]) == 0


# ----- case 14 -----------------------------------------------------------------------------------
def test_case14_same_model_twice_warns(folder):
    config = {
        "method": "task_arithmetic",
        "base_model": "base.safetensors",
        "models": [
            {"model": "a.safetensors", "alpha": 0.5},
            {"model": "b.safetensors"},
            {"model": "./sub/../a.safetensors", "alpha": 0.25},
        ],
    }
    (folder / "sub").mkdir()
    with pytest.warns(
        gm.InputWarning, match=r"models\[0\].model and models\[2\].model are the same"
    ):
        MergeConfig.from_dict(config, root=folder)


def test_case14_distinct_models_do_not_warn(folder, recwarn):
    config = {
        "method": "task_arithmetic",
        "base_model": "base.safetensors",
        "models": [{"model": "a.safetensors"}, {"model": "b.safetensors"}],
    }
    MergeConfig.from_dict(config, root=folder)
    assert not [w for w in recwarn if issubclass(w.category, gm.InputWarning)]


@pytest.mark.parametrize("command", ["merge", "remove", "refine"])
@pytest.mark.parametrize("form", ["flow list", "block list", "flow mapping"])
def test_issue29_deep_nesting_is_a_config_error(folder, capsys, command, form):
    """A YAML value nested 5,000 deep (the adversarial pass's RecursionError traceback) is a
    ConfigError on one line, from every reader of configuration files."""
    depth = 5000
    nested = {
        "flow list": "[" * depth + "]" * depth,
        "block list": "\n".join(" " * i + "-" for i in range(depth)),
        "flow mapping": "{a: " * depth + "1" + "}" * depth,
    }[form]
    path = folder / "deep.yaml"
    path.write_text(f"method: task_arithmetic\nbase_model: base.safetensors\nmodels:\n  {nested}\n"
                    if form != "block list" else f"models:\n{nested}\n")  # fmt: skip
    code = cli.main([command, str(path), str(folder / "out")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert f"gradmerge {command}: error:" in err and "nests deeper than" in err
    assert "Traceback" not in err and not (folder / "out").exists()
    with pytest.raises(ConfigError, match="nests deeper than"):
        MergeConfig.from_yaml(path)


@pytest.mark.parametrize("patterns", [["*"], ["w", "*"], ["w*"]])
def test_issue29_passthrough_covering_every_tensor_warns(folder, capsys, patterns):
    """Nothing merged: the output is the base unchanged; said on one line (exit 0, as asked)."""
    config = {
        "method": "task_arithmetic",
        "base_model": "base.safetensors",
        "models": [{"model": "a.safetensors"}],
        "passthrough": patterns,
    }
    (folder / "p.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["merge", str(folder / "p.yaml"), str(folder / "out"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "warning" in line]
    assert len(lines) == 1 and "covers every floating-point tensor" in lines[0]
    assert "the output is the base model unchanged" in lines[0]
    with pytest.warns(gm.InputWarning, match="covers every floating-point tensor"):
        gm.run_merge(MergeConfig.from_yaml(folder / "p.yaml"), folder / "out2", progress=False)


def test_issue29_passthrough_of_some_tensors_does_not_warn(folder, recwarn):
    import torch

    for name in ("base", "a"):
        save_file({"w": torch.ones(2), "head": torch.ones(3)}, folder / f"{name}.safetensors")
    config = {
        "method": "task_arithmetic",
        "base_model": "base.safetensors",
        "models": [{"model": "a.safetensors"}],
        "passthrough": ["head"],
    }
    gm.run_merge(MergeConfig.from_dict(config, root=folder), folder / "out", progress=False)
    assert not [w for w in recwarn if issubclass(w.category, gm.InputWarning)]
