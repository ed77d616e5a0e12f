"""`gradmerge evaluate MODEL... --data DATA... --compare REF`: several data files in one call, and
each model's difference to REF with paired-bootstrap intervals.

References: the single-file form of the same command, file by file (its rows are checked against
Hugging Face's loss in test_evaluate_command.py); the differences by hand from the per-example
lists; the intervals from :func:`gradmerge.bootstrap.paired_bootstrap` on those lists (whose
distribution is checked against the exact bootstrap in proofs_tests/unit/test_bootstrap.py).
Then bad input, as cases: nothing written, the error naming what failed.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

from gradmerge import cli
from gradmerge.bootstrap import paired_bootstrap
from proofs_tests.commands.test_evaluate_command import REVIEWS
from proofs_tests.text_models import bert_classifier

ANIMALS = [
    ("the cat ran fast", "positive"),
    ("a small dog", "neutral"),
    ("the dog sat on a red mat", "negative"),
    ("big cat", "positive"),
    ("the slow dog is not good", "negative"),
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    return {
        "bert0": bert_classifier(root / "bert0", seed=0),
        "bert1": bert_classifier(root / "bert1", seed=1),
        "bert2": bert_classifier(root / "bert2", seed=2),
        "reviews": _jsonl(root / "reviews.jsonl", REVIEWS),
        "animals": _jsonl(root / "animals.jsonl", ANIMALS),
        "root": root,
    }


def _report(capsys, *argv):
    capsys.readouterr()
    assert cli.main(["evaluate", *map(str, argv), "--no-progress", "--out", "-"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_every_model_on_every_file_equals_the_single_file_form(folders, capsys):
    models = [folders["bert0"], folders["bert1"]]
    datas = [folders["reviews"], folders["animals"]]
    report, _ = _report(capsys, *models, "--data", *datas, "--per-example")
    assert report["format"] == "gradmerge-evaluate/2"
    assert report["data"] == [str(d) for d in datas]
    assert [(r["model"], r["data"]) for r in report["models"]] == [
        (str(m), str(d)) for m in models for d in datas
    ]
    for data in datas:
        single, _ = _report(capsys, *models, data, "--per-example")
        assert single["data"] == [str(data)]
        rows = [r for r in report["models"] if r["data"] == str(data)]
        for row, alone in zip(rows, single["models"], strict=True):
            for key in ("model", "examples", "accuracy", "mean_loss", "per_example"):
                assert row[key] == alone[key], key
    for mean in report["mean_over_data"]:
        rows = [r for r in report["models"] if r["model"] == mean["model"]]
        assert math.isclose(mean["accuracy"], sum(r["accuracy"] for r in rows) / 2)
        assert math.isclose(mean["mean_loss"], sum(r["mean_loss"] for r in rows) / 2)
    # --data repeated is the same call
    again, _ = _report(capsys, *models, "--data", datas[0], "--data", datas[1], "--per-example")
    assert [r["per_example"] for r in again["models"]] == [
        r["per_example"] for r in report["models"]
    ]


def test_compare_by_hand_and_against_the_bootstrap_function(folders, capsys):
    models = [folders["bert0"], folders["bert1"], folders["bert2"]]
    datas = [folders["reviews"], folders["animals"]]
    argv = [*models, "--data", *datas, "--per-example", "--compare", "bert1"]  # REF by name
    report, table = _report(capsys, *argv, "--resamples", 500, "--seed", 3)
    comparison = report["comparison"]
    assert comparison["reference"] == str(folders["bert1"])
    assert (comparison["resamples"], comparison["seed"], comparison["level"]) == (500, 3, 0.95)
    rows = {(r["model"], r["data"]): r["per_example"] for r in report["models"]}
    ref = str(folders["bert1"])
    assert [e["model"] for e in comparison["models"]] == [str(folders["bert0"]),
                                                          str(folders["bert2"])]  # fmt: skip
    for entry in comparison["models"]:
        model = entry["model"]
        accuracy_differences = []
        for data, figures in zip(datas, entry["data"], strict=True):
            mine, theirs = rows[model, str(data)], rows[ref, str(data)]
            n = len(mine["correct"])
            by_hand = (sum(mine["correct"]) - sum(theirs["correct"])) / n
            assert math.isclose(figures["accuracy"]["difference"], by_hand, abs_tol=1e-15)
            loss = (sum(mine["loss"]) - sum(theirs["loss"])) / n
            assert math.isclose(figures["mean_loss"]["difference"], loss, rel_tol=1e-12)
            accuracy_differences.append(by_hand)
        pooled = entry["pooled"]["accuracy"]
        assert math.isclose(pooled["difference"], sum(accuracy_differences) / 2, abs_tol=1e-15)
        for figure, key in (("accuracy", "correct"), ("mean_loss", "loss")):
            expected = paired_bootstrap(
                [rows[model, str(d)][key] for d in datas],
                [rows[ref, str(d)][key] for d in datas],
                resamples=500,
                seed=3,
            )
            assert entry["pooled"][figure]["interval"] == [expected.pooled.low,
                                                           expected.pooled.high]  # fmt: skip
            for k, figures in enumerate(entry["data"]):
                assert figures[figure]["interval"] == [expected.strata[k].low,
                                                       expected.strata[k].high]  # fmt: skip
    assert f"difference to REF {ref}" in table and "mean over 2 DATA" in table
    # seeded: the same call gives the same intervals, another seed others; REF by path too
    same, _ = _report(capsys, *argv[:-1], ref, "--resamples", 500, "--seed", 3)
    assert same["comparison"] == comparison
    other, _ = _report(capsys, *argv, "--resamples", 500, "--seed", 4)
    assert other["comparison"]["models"] != comparison["models"]


def test_the_defaults_and_the_json_file(folders, tmp_path, capsys):
    out = tmp_path / "scores.json"
    argv = [folders["bert0"], folders["bert1"], folders["reviews"], "--compare",
            folders["bert0"], "--out", out, "--no-progress"]  # fmt: skip
    assert cli.main(["evaluate", *map(str, argv)]) == 0
    report = json.loads(out.read_text())
    assert (report["comparison"]["resamples"], report["comparison"]["seed"]) == (2000, 0)
    entry = report["comparison"]["models"][0]
    assert entry["pooled"] == {k: entry["data"][0][k] for k in ("accuracy", "mean_loss")}
    printed = capsys.readouterr().out
    assert "difference to REF" in printed and "mean over" not in printed  # one DATA


def _twin(folders, tmp_path):
    """A copy of bert0 in another folder of the same name: --compare bert0 is ambiguous."""
    twin = tmp_path / "other" / "bert0"
    shutil.copytree(folders["bert0"], twin)
    return twin


def _empty(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    return tmp_path / "empty.jsonl"


def _other_labels(tmp_path):
    rows = [("the cat sat", "entailment"), ("a dog", "contradiction")]
    return _jsonl(tmp_path / "nli.jsonl", rows)


def _long(tmp_path):
    """Texts longer than the models' 24 positions: every model fails on this file only."""
    return _jsonl(tmp_path / "long.jsonl", [(" ".join(["the cat sat on the mat"] * 6), "neutral")])


BAD = [
    # (name, argv builder, exit code, stderr fragment)
    ("REF not among the models", lambda f, t: [f["bert0"], f["bert1"], "--data", f["reviews"],
                                               "--compare", "bert9"], 2, "is not among the MODELs"),
    ("REF names two models", lambda f, t: [f["bert0"], _twin(f, t), "--data", f["reviews"],
                                           "--compare", "bert0"], 2, "names several MODELs"),
    ("REF is the only model", lambda f, t: [f["bert0"], "--data", f["reviews"], "--compare",
                                            "bert0"], 2, "at least two MODELs"),
    ("--seed without --compare", lambda f, t: [f["bert0"], f["reviews"], "--seed", 1], 2,
     "applies to --compare"),
    ("no resamples", lambda f, t: [f["bert0"], f["bert1"], f["reviews"], "--compare", "bert0",
                                   "--resamples", 0], 2, "at least 1"),
    ("negative seed", lambda f, t: [f["bert0"], f["bert1"], f["reviews"], "--compare", "bert0",
                                    "--seed", -1], 2, "non-negative"),
    ("no DATA", lambda f, t: [f["bert0"]], 2, "give MODEL... DATA"),
    ("a model after --data", lambda f, t: [f["bert0"], "--data", f["reviews"], f["bert1"]], 2,
     "is a model folder"),
    ("a file given twice", lambda f, t: [f["bert0"], "--data", f["reviews"], f["reviews"]], 2,
     "given twice"),
    ("--out is the second DATA", lambda f, t: [f["bert0"], "--data", f["reviews"], f["animals"],
                                               "--out", f["animals"], "--overwrite"], 2,
     "is DATA"),
    ("empty file", lambda f, t: [f["bert0"], f["bert1"], "--data", f["reviews"], _empty(t),
                                 "--compare", "bert0"], 1, "on DATA {t}/empty.jsonl: DATA"),
    ("labels the models lack", lambda f, t: [f["bert0"], f["bert1"], "--data", f["reviews"],
                                             _other_labels(t), "--compare", "bert0"], 1,
     "MODEL {f[bert0]} on DATA {t}/nli.jsonl"),
    ("a model failing on one file", lambda f, t: [f["bert0"], f["bert1"], "--data", f["reviews"],
                                                  _long(t), "--compare", "bert0"], 1,
     "MODEL {f[bert0]} on DATA {t}/long.jsonl"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "argv", "code", "message"), BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_refused_and_writes_nothing(folders, tmp_path, capsys, name, argv, code,
                                                 message):  # fmt: skip
    out = tmp_path / "scores.json"
    out.write_text("{}")  # an earlier report: never clobbered by a failing run
    args = ["evaluate", *map(str, argv(folders, tmp_path)), "--no-progress"]
    if "--out" not in args:
        args += ["--out", str(out), "--overwrite"]
    if code == 2:
        with pytest.raises(SystemExit) as exit_:
            cli.main(args)
        assert exit_.value.code == 2
    else:
        assert cli.main(args) == 1
    assert message.format(f=folders, t=tmp_path) in capsys.readouterr().err
    assert out.read_text() == "{}"


MLP = """
import torch

def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 2)).double()
"""


def test_mse_differences_have_no_accuracy(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    (tmp_path / "m.py").write_text(MLP)
    (tmp_path / "n.py").write_text(MLP.replace("seed=0", "seed=1"))
    g = torch.Generator().manual_seed(0)
    datas = []
    for name, n in (("a", 9), ("b", 6)):
        x = torch.randn(n, 3, generator=g, dtype=torch.float64)
        y = torch.randn(n, 2, generator=g, dtype=torch.float64)
        save_file({"inputs": x, "targets": y}, tmp_path / f"{name}.safetensors")
        datas.append(tmp_path / f"{name}.safetensors")
    a, b = f"{tmp_path / 'm.py'}:mlp", f"{tmp_path / 'n.py'}:mlp"
    report, _ = _report(capsys, a, b, "--data", *datas, "--loss", "mse", "--compare", a,
                            "--per-example")  # fmt: skip
    entry = report["comparison"]["models"][0]
    assert entry["pooled"]["accuracy"] is None
    rows = {(r["model"], r["data"]): r for r in report["models"]}
    losses = [rows[b, str(d)]["mean_loss"] - rows[a, str(d)]["mean_loss"] for d in datas]
    for figures, by_hand in zip(entry["data"], losses, strict=True):
        assert figures["accuracy"] is None
        assert math.isclose(figures["mean_loss"]["difference"], by_hand, rel_tol=1e-12)
    assert math.isclose(entry["pooled"]["mean_loss"]["difference"], sum(losses) / 2, rel_tol=1e-12)
    assert report["mean_over_data"][0]["accuracy"] is None


DRIFTING = """
import torch

calls = 0

def data():
    global calls
    calls += 1
    g = torch.Generator().manual_seed(0)
    n = 4 + calls  # another size on every call: no pairs to compare
    return [(torch.randn(n, 3, generator=g, dtype=torch.float64),
             torch.randn(n, 2, generator=g, dtype=torch.float64))]
"""


def test_data_that_changes_between_models_is_refused(tmp_path, capsys):
    (tmp_path / "m.py").write_text(MLP)
    (tmp_path / "n.py").write_text(MLP.replace("seed=0", "seed=1"))
    (tmp_path / "d.py").write_text(DRIFTING)
    out = tmp_path / "scores.json"
    args = ["evaluate", f"{tmp_path / 'm.py'}:mlp", f"{tmp_path / 'n.py'}:mlp",
            f"{tmp_path / 'd.py'}:data", "--loss", "mse", "--compare", "mlp", "--out", str(out),
            "--no-progress"]  # fmt: skip
    with pytest.raises(SystemExit):  # "mlp" is no MODEL's name: entry points go by their spec
        cli.main(args)
    args[args.index("mlp")] = f"{tmp_path / 'm.py'}:mlp"
    assert cli.main(args) == 1
    assert "a paired comparison needs the same examples" in capsys.readouterr().err
    assert not out.exists()
