"""`gradmerge merge` and `gradmerge remove` end to end, through cli.main."""

import pytest
import torch
from safetensors.torch import load_file

import gradmerge as gm
from gradmerge import cli
from proofs_tests.workspace import make_workspace


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("cli"), "kfac")


def _merge_yaml(ws, **changes):
    prior = {"delta": 1.0e-2, "curvature": "base.curvature.safetensors"}
    config = ws.merge_dict(alpha=0.5, **{"prior": prior, **changes})
    return str(ws.yaml("merge.yaml", config))


def test_merge_end_to_end(ws, tmp_path, capsys):
    out = tmp_path / "merged"
    assert cli.main(["merge", _merge_yaml(ws), str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "gradient_matching: wrote 6 tensors (6 merged, 0 copied from the base)" in text
    got = load_file(out / "model.safetensors")
    base, fts = ws.load(ws.base), [ws.load(m) for m in ws.models]
    hs = [ws.curvature(c) for c in ws.curvatures]
    prior = ws.curvature(ws.base_curvature) + 1e-2
    expected = gm.gradient_matching(base, fts, hs, prior=prior, alphas=0.5)
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0)

    with pytest.raises(SystemExit) as info:  # exists: the output guard, before any work
        cli.main(["merge", _merge_yaml(ws), str(out)])
    assert info.value.code == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert cli.main(["merge", _merge_yaml(ws), str(out), "--overwrite", "--no-progress"]) == 0


def test_dry_run_writes_nothing(ws, tmp_path, capsys):
    out = tmp_path / "merged"
    assert cli.main(["merge", _merge_yaml(ws), str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "inputs fit together" in text and "6 merged in 4 groups" in text
    assert not out.exists()


def test_bad_config_is_one_line_on_stderr(ws, tmp_path, capsys):
    assert cli.main(["merge", _merge_yaml(ws, merge_method="x"), str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("gradmerge merge: error: unknown key 'merge_method'")
        and err.count("\n") == 1
    )
    assert cli.main(["merge", str(tmp_path / "absent.yaml"), str(tmp_path / "o")]) == 1
    assert "no configuration file" in capsys.readouterr().err


def test_remove_end_to_end(ws, tmp_path, capsys):
    config = {
        "method": "remove",
        "base_model": "base.safetensors",
        "model": "ft0.safetensors",
        "curvature": "ft0.curvature.safetensors",
        "prior": {"delta": 1.0e-2},
        "remaining": {"delta": 1.0e-1, "curvature": "base.curvature.safetensors"},
    }
    out = tmp_path / "removed"
    assert cli.main(["remove", str(ws.yaml("remove.yaml", config)), str(out), "--no-progress"]) == 0
    assert "remove: wrote 6 tensors" in capsys.readouterr().out
    assert (out / "gradmerge_remove.json").is_file()
    got = load_file(out / "model.safetensors")
    rest = ws.curvature(ws.base_curvature) + 1e-1
    expected = gm.remove(
        ws.load(ws.base),
        ws.load(ws.models[0]),
        ws.curvature(ws.curvatures[0]),
        remaining=rest,
        prior=1e-2,
    )
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("command", "needles"),
    [
        (
            "merge",
            [
                "examples:",
                "method: gradient_matching",
                "prior: {delta",
                "docs/config.md",  # every key is described there, once
                "--dry-run",
            ],
        ),
        (
            "remove",
            [
                "examples:",
                "method: remove",
                "method: influence_remove",
                "gradient:",
                "remaining:",
                "docs/config.md",
            ],
        ),
    ],
)
def test_help_has_the_yaml_and_examples(command, needles, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for needle in needles:
        assert needle in text, needle


def test_progress_bar_only_on_a_terminal(ws, tmp_path, monkeypatch):
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    config = gm.MergeConfig.from_yaml(_merge_yaml(ws))
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    gm.run_merge(config, tmp_path / "a", progress=True)
    assert "gradmerge merge" in terminal.getvalue() and "100%" in terminal.getvalue()
    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    gm.run_merge(config, tmp_path / "b", progress=False)
    assert quiet.getvalue() == ""
