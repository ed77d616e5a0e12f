"""`gradmerge tune`'s argument errors: one class, one code, before any work (issue 38, cases 9
and 10).

9: ``--scales=-1`` (and ``nan``, ``inf``) exited 1 after CONFIG and the DATA were read, while
``abc`` and an empty grid exited 2: every value a grid cannot take is now an argparse error
(exit 2, one line), and so is every count or grid that does not fit CONFIG (a DATA per model, a
``--validation`` per model, δ for a method without a prior, a prior made zero).
10: ``--out X --out-dir X`` ran the whole grid, wrote X as a folder, then failed on ``--out``:
two outputs of one run that are, lie inside or contain each other are refused by the output
guard before any work, as an output that overlaps an input is.

Tiny random-weight BERT folders (proofs_tests/text_models.py); ``jobs.tune.tune`` is replaced by
a function that fails the test if called, so that "before any work" is asserted by count.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import yaml

from gradmerge import cli
from proofs_tests.text_models import bert_classifier

ROWS = [("the movie was very good", "positive"), ("a dull film", "negative")]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """base/, a/ and b/ (random BERTs), a.jsonl, b.jsonl, ta.yaml (task arithmetic of a and b)
    and gm.yaml (gradient matching without a prior curvature: no curvature needed to read)."""
    root = tmp_path_factory.mktemp("tune-args")
    for seed, name in enumerate(("base", "a", "b")):
        bert_classifier(root / name, seed=seed)
    for name in ("a.jsonl", "b.jsonl"):
        (root / name).write_text(
            "".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in ROWS)
        )
    models = [{"model": "a"}, {"model": "b"}]
    (root / "ta.yaml").write_text(
        yaml.safe_dump({"method": "task_arithmetic", "base_model": "base", "models": models})
    )
    return root


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the grid starts (a merge or a scoring)."""

    def ran(*args, **kwargs):
        raise AssertionError("the grid ran")

    monkeypatch.setattr("gradmerge.jobs.tune.tune", ran)
    monkeypatch.setattr("gradmerge.commands.tune.Scorer.read", ran)


def _refused(argv, capsys) -> str:
    """The one error line of an argparse refusal (exit 2)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert re.match(r"gradmerge( tune)?: error: ", lines[-1]), err  # argparse's, check()'s
    assert not any("error" in line for line in lines[:-1]), err  # one line, after the usage
    return lines[-1]


def _argv(ws, *flags):
    return ["tune", str(ws / "ta.yaml"), str(ws / "a.jsonl"), str(ws / "b.jsonl"), *flags]


GRIDS = [
    ("--scales", "-1"),
    ("--scales", "nan"),
    ("--scales", "inf"),
    ("--scales", "-inf"),
    ("--scales", "0.5,-0.5"),
    ("--scales", "1,NaN"),
    ("--scales", "abc"),
    ("--scales", ""),
    ("--scales", ","),
    ("--deltas", "-1e-3"),
    ("--deltas", "nan"),
    ("--prior-scales", "inf"),
]


@pytest.mark.parametrize(("flag", "value"), GRIDS, ids=[f"{f}={v}" for f, v in GRIDS])
def test_case9_every_value_a_grid_cannot_take_exits_2(ws, capsys, no_work, flag, value):
    flags = [f"{flag}={value}"] + (["--scales", "1"] if flag != "--scales" else [])
    line = _refused(_argv(ws, *flags), capsys)
    assert line == (
        f"gradmerge tune: error: argument {flag}: expected comma-separated finite numbers >= 0, "
        f"e.g. 0.2,0.5,1.0; got {value!r}"
    )


@pytest.mark.parametrize(
    "flags", [["--alphas", "0.5,1"], ["--alphas=0.5,1"], ["--scales", "1", "--alphas"]]
)
def test_the_old_grid_flag_alphas_is_refused_naming_scales(ws, capsys, no_work, flags):
    """--alphas was the grid of CONFIG's scale; α now names only a model's own weight
    (models[].alpha), so the old flag exits 2 with one line naming --scales."""
    line = _refused(_argv(ws, *flags), capsys)
    value = "0.5,1" if "0.5,1" in " ".join(flags) else "0.2,0.5,1"
    assert line == f"gradmerge tune: error: --alphas was renamed --scales: give --scales {value}"


FITS = [
    (["--scales", "1", "--deltas", "0.1"], "method task_arithmetic has no prior"),
    (["--scales", "1", "--validation", "@a.jsonl"], "1 --validation DATA were given for 2 DATA"),
    (["--scales", "1", "--max-length", "8,8,8"], "--max-length gives 3 values for 2 DATA"),
    (["--scales", "1", "--max-length", "0"], "argument --max-length: expected a whole number"),
]


@pytest.mark.parametrize(("flags", "message"), FITS, ids=[m.split(":")[0] for _, m in FITS])
def test_case9_arguments_that_do_not_fit_config_exit_2_before_any_work(
    ws, capsys, no_work, flags, message
):
    flags = [str(ws / f[1:]) if f.startswith("@") else f for f in flags]
    assert message in _refused(_argv(ws, *flags), capsys)


def test_case9_a_data_count_that_does_not_fit_config_exits_2(ws, capsys, no_work):
    argv = ["tune", str(ws / "ta.yaml"), str(ws / "a.jsonl"), "--scales", "1"]
    assert "merges 2 models but 1 DATA were given" in _refused(argv, capsys)


OVERLAPS = [  # (--out, --out-dir, the refusal)
    ("x", "x", "--out-dir {d} is --out {o}"),
    ("x/report.json", "x", "--out-dir {d} contains --out {o}"),
    ("x", "x/model", "--out-dir {d} lies inside --out {o}"),
    ("link", "x", "--out-dir {d} is --out {o}"),  # a symlink to x
]


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize(("out", "out_dir", "message"), OVERLAPS)
def test_case10_overlapping_outputs_are_refused_before_any_work(
    ws, tmp_path, capsys, no_work, out, out_dir, message, overwrite
):
    (tmp_path / "link").symlink_to(tmp_path / "x")
    o, d = tmp_path / out, tmp_path / out_dir
    flags = ["--scales", "0,1", "--out", str(o), "--out-dir", str(d)]
    line = _refused(_argv(ws, *flags, *(["--overwrite"] if overwrite else [])), capsys)
    shown = str(o) + (f" (= {tmp_path / 'x'})" if out == "link" else "")
    assert message.format(o=shown, d=d) in line
    assert "the run writes both" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]  # nothing written


def test_case10_separate_outputs_are_both_written(ws, tmp_path, capsys):
    """The control: the same call with --out beside --out-dir runs the grid and writes both."""
    out, keep = tmp_path / "x" / "report.json", tmp_path / "x-model"
    flags = ["--scales", "0,1", "--out", str(out), "--out-dir", str(keep), "--no-progress"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a choice at the grid's edge warns
        assert cli.main(_argv(ws, *flags)) == 0
    assert len(json.loads(out.read_text())["points"]) == 2
    assert (keep / "gradmerge_merge.json").is_file()
