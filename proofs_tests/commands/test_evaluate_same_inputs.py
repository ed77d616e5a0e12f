"""`gradmerge evaluate`: a MODEL or DATA given twice under two spellings, and comparisons of
unlike figures, are refused before they can mislead (exit 2, one line, nothing written).

References: the path relation by construction (the same file through ``.``, ``..``, a symlink; a
copy with the same bytes); the work done by a count of the models loaded (a spy on the command's
``load_model``), never by time.
"""

from __future__ import annotations

import json
import shutil

import pytest

from gradmerge import cli
from gradmerge.commands import evaluate as evaluate_command
from proofs_tests.commands.test_evaluate_command import REVIEWS
from proofs_tests.text_models import bert_classifier, gpt2_lm


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("same")
    d = root / "d"
    a = _jsonl(d / "a.jsonl", REVIEWS)
    shutil.copy(a, d / "copy.jsonl")  # the same bytes under another name
    # the same size, other bytes: a distinct test set that must be accepted
    (d / "other.jsonl").write_text(a.read_text().replace("movie", "mOvie"))
    (d / "link.jsonl").symlink_to(a)
    bert0 = bert_classifier(root / "bert0", seed=0)
    (root / "alias").symlink_to(bert0, target_is_directory=True)
    return {
        "root": root,
        "d": d,
        "bert0": bert0,
        "bert1": bert_classifier(root / "bert1", seed=1),
        "gpt2": gpt2_lm(root / "gpt2"),
    }


@pytest.fixture
def loads(monkeypatch):
    """The MODELs the command loads, in order."""
    seen: list[str] = []
    real = evaluate_command.load_model

    def spy(args, device, spec):
        seen.append(spec)
        return real(args, device, spec)

    monkeypatch.setattr(evaluate_command, "load_model", spy)
    return seen


def _refused(argv, cwd, monkeypatch, capsys, tmp_path):
    """Run the command in ``cwd``: exit 2, its one-line message, no --out written."""
    monkeypatch.chdir(cwd)
    out = tmp_path / "scores.json"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["evaluate", *map(str, argv), "--no-progress", "--out", str(out)])
    assert exit_.value.code == 2
    assert not out.exists()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    return err


SAME_DATA = [
    # (name, the DATA as given in the root folder, what the message says)
    ("dot", ["d/a.jsonl", "d/./a.jsonl"], "are the same file"),
    ("dot-dot", ["d/a.jsonl", "d/../d/a.jsonl"], "are the same file"),
    ("absolute", ["d/a.jsonl", "{root}/d/a.jsonl"], "are the same file"),
    ("symlink", ["d/a.jsonl", "d/link.jsonl"], "are the same file"),
    ("a copy", ["d/a.jsonl", "d/copy.jsonl"], "hold the same bytes"),
    ("a copy, third", ["d/a.jsonl", "d/other.jsonl", "d/copy.jsonl"], "hold the same bytes"),
]


@pytest.mark.parametrize(("name", "datas", "message"), SAME_DATA, ids=[c[0] for c in SAME_DATA])
def test_the_same_data_twice_is_refused_before_any_model_loads(
    folders, loads, monkeypatch, capsys, tmp_path, name, datas, message
):
    datas = [d.format(root=folders["root"]) for d in datas]
    err = _refused(["bert0", "--data", *datas], folders["root"], monkeypatch, capsys, tmp_path)
    assert message in err and "give each DATA once" in err
    assert datas[0] in err
    assert loads == []  # refused before any work


def test_distinct_data_of_the_same_size_are_scored(folders, loads, monkeypatch, capsys):
    monkeypatch.chdir(folders["root"])
    assert (folders["d"] / "a.jsonl").stat().st_size == (
        folders["d"] / "other.jsonl"
    ).stat().st_size
    code = cli.main(["evaluate", "bert0", "--data", "d/a.jsonl", "d/other.jsonl", "--no-progress"])
    assert code == 0 and loads == ["bert0"]


SAME_MODEL = [
    ("dot", ["bert0", "./bert0"], "./bert0"),
    ("trailing slash", ["bert0", "bert1", "bert0/"], "bert0"),
    ("symlink", ["bert0", "alias"], "alias"),
]


@pytest.mark.parametrize(("name", "models", "ref"), SAME_MODEL, ids=[c[0] for c in SAME_MODEL])
def test_a_model_compared_with_itself_is_refused(
    folders, loads, monkeypatch, capsys, tmp_path, name, models, ref
):
    argv = [*models, "--data", "d/a.jsonl", "--compare", ref]
    err = _refused(argv, folders["root"], monkeypatch, capsys, tmp_path)
    assert "are the same folder" in err and "give each MODEL once" in err
    assert loads == []
    # and without --compare: scoring one model twice is refused as well
    err = _refused([*models, "d/a.jsonl"], folders["root"], monkeypatch, capsys, tmp_path)
    assert "are the same folder" in err


def test_one_reference_named_twice_is_refused(folders, loads, monkeypatch, capsys, tmp_path):
    argv = ["bert0", "bert1", "--data", "d/a.jsonl", "--compare", "bert0", "./bert0"]
    err = _refused(argv, folders["root"], monkeypatch, capsys, tmp_path)
    assert "--compare names MODEL bert0 twice" in err
    assert loads == []


def test_a_causal_lm_compared_with_a_classifier_is_refused_at_the_first_unlike_model(
    folders, loads, monkeypatch, capsys, tmp_path
):
    """The issue's case: GPT-2's next-token accuracy against a classifier's per-example
    accuracy. REF is scored first, so the command stops at the first unlike model: the third
    MODEL is never loaded."""
    argv = ["gpt2", "bert1", "bert0", "--data", "d/a.jsonl", "--compare", "bert0"]
    monkeypatch.chdir(folders["root"])
    out = tmp_path / "scores.json"
    capsys.readouterr()
    code = cli.main(["evaluate", *argv, "--no-progress", "--out", str(out)])
    assert code == 2
    assert not out.exists()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("gradmerge evaluate: error: --compare: MODEL gpt2 is scored by "
                          "next-token accuracy")  # fmt: skip
    assert "REF bert0 by accuracy and loss per example (a classifier)" in err
    assert loads == ["bert0", "gpt2"]
    # the same models without --compare: each is scored by its own figure, nothing compared
    code = cli.main(["evaluate", "gpt2", "bert0", "--data", "d/a.jsonl", "--no-progress",
                     "--out", str(out)])  # fmt: skip
    assert code == 0
    levels = [row["level"] for row in json.loads(out.read_text())["models"]]
    assert levels == ["token", "example"]


def test_the_library_error_is_typed():
    from gradmerge.errors import ArgumentError, ComparisonError

    assert issubclass(ComparisonError, ArgumentError)
