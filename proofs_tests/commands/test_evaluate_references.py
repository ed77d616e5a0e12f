"""`gradmerge evaluate --compare A B`: several references in one pass.

Reference: separate single-reference runs of the same command (whose comparisons are checked by
hand and against :func:`gradmerge.bootstrap.paired_bootstrap` in test_evaluate_compare.py). The
pass scores each MODEL once (a count of the models loaded, a spy on the command's
``load_model``) and its comparisons equal the separate runs' to the last bit (the draws depend
only on the seed and the DATA sizes).
"""

from __future__ import annotations

import json

import pytest

from gradmerge import cli
from gradmerge.commands import evaluate as evaluate_command
from proofs_tests.commands.test_evaluate_command import REVIEWS
from proofs_tests.commands.test_evaluate_compare import ANIMALS, _jsonl
from proofs_tests.text_models import bert_classifier


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("references")
    return {
        **{f"bert{s}": bert_classifier(root / f"bert{s}", seed=s) for s in range(3)},
        "reviews": _jsonl(root / "reviews.jsonl", REVIEWS),
        "animals": _jsonl(root / "animals.jsonl", ANIMALS),
    }


def _report(capsys, *argv):
    capsys.readouterr()
    assert cli.main(["evaluate", *map(str, argv), "--no-progress", "--out", "-"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


@pytest.mark.parametrize("spelling", ["one flag", "repeated flag"])
def test_several_references_equal_separate_runs_and_score_each_model_once(
    folders, capsys, monkeypatch, spelling
):
    loads: list[str] = []
    real = evaluate_command.load_model

    def spy(args, device, spec):
        loads.append(spec)
        return real(args, device, spec)

    models = [folders["bert0"], folders["bert1"], folders["bert2"]]
    common = [*models, "--data", folders["reviews"], folders["animals"], "--per-example",
              "--resamples", 300, "--seed", 5]  # fmt: skip
    refs = ["--compare", "bert2", "bert0"]
    if spelling == "repeated flag":
        refs = ["--compare", "bert2", "--compare", "bert0"]
    monkeypatch.setattr(evaluate_command, "load_model", spy)
    both, table = _report(capsys, *common, *refs)
    assert sorted(loads) == sorted(map(str, models))  # each MODEL scored once
    monkeypatch.undo()
    assert both["format"] == "gradmerge-evaluate/2"
    assert both["comparison"] == both["comparisons"][0]  # the first REF's, as with one
    assert [c["reference"] for c in both["comparisons"]] == [str(models[2]), str(models[0])]
    for comparison, ref in zip(both["comparisons"], ("bert2", "bert0"), strict=True):
        alone, _ = _report(capsys, *common, "--compare", ref)
        assert alone["comparisons"] == [comparison]  # every figure and interval, exactly
        assert alone["models"] == [
            {**row, "seconds": alone_row["seconds"]}
            for row, alone_row in zip(both["models"], alone["models"], strict=True)
        ]  # the rows too, in the MODELs' order
        others = [e["model"] for e in comparison["models"]]
        assert others == [str(m) for m in models if m.name != ref]
    for ref in (models[2], models[0]):
        assert f"difference to REF {ref} " in table


def test_data_after_the_references_is_named(folders, capsys):
    """--compare takes every argument after it: DATA written after it is not taken for a REF
    silently, nor reported as a MODEL folder given as DATA."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["evaluate", str(folders["bert0"]), str(folders["bert1"]), "--compare", "bert0",
                  str(folders["reviews"])])  # fmt: skip
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--compare {folders['reviews']}: a file, not a MODEL" in err
    assert "give DATA before --compare" in err
