"""`gradmerge tune --base-data`, each task's term, the grid-edge warning and the diagnostic one.

References computed here without gradmerge's merge or evaluation code (the fixtures of
test_tune_command.py): each setting's merged weights by hand, HF's cross-entropy one example at a
time, the summed gradients by HF's loss × N and autograd. The base task is base_model with its
own training data; its mismatch reference is the gradient at base_model.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradmerge.errors import SelectionWarning
from gradmerge.jobs.tune import Setting, grid_edges
from proofs_tests.commands.test_tune_command import (
    HELD_OUT,
    TASKS,
    _accuracy,
    _config,
    _gradient,
    _load,
    _mean_loss,
    _task_arithmetic,
    _tune,
    _weights,
    setup,  # noqa: F401 (the module's fixture)
)

BASE = [
    ("a fine good film", "positive"),
    ("the dull bad plot", "negative"),
    ("the mat is red", "neutral"),
    ("good fun", "positive"),
]
BASE_HELD_OUT = [("a good plot", "positive"), ("a bad film", "negative")]


def _write(path, rows):
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    return path


@pytest.fixture
def base_data(tmp_path):
    return _write(tmp_path / "base.jsonl", BASE)


def test_the_base_task_is_scored_like_the_others_and_reported_apart(
    setup,  # noqa: F811
    base_data,
    tmp_path,
    capsys,
):
    config = _config(setup, "ta.yaml", "task_arithmetic")
    held_out = [_write(tmp_path / f"{t}.val.jsonl", rows) for t, rows in HELD_OUT.items()]
    base_held_out = _write(tmp_path / "base.val.jsonl", BASE_HELD_OUT)
    out, scales = tmp_path / "tune.json", [0.0, 0.5, 1.0]
    flags = ["--scales", "0,0.5,1", "--base-data", base_data, "--out", out]
    flags += ["--validation", held_out[0], "--validation", held_out[1]]
    assert _tune(setup, config, *flags, "--base-validation", base_held_out) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["base_data"] == str(base_data.resolve())
    scores = []
    for point, scale in zip(report["points"], scales, strict=True):
        model = _load(setup, _task_arithmetic(setup, scale))
        losses = [_mean_loss(model, setup, t) for t in TASKS]
        base = _mean_loss(model, setup, BASE)
        assert [task["term"] for task in point["tasks"]] == [
            task["mean_loss"] for task in point["tasks"]
        ]
        for task, loss in zip(point["tasks"], losses, strict=True):
            assert math.isclose(task["term"], loss, rel_tol=1e-9)
        assert point["base"]["examples"] == len(BASE)
        assert math.isclose(point["base"]["term"], base, rel_tol=1e-9)
        assert math.isclose(point["criterion"], sum(losses) + base, rel_tol=1e-9)
        # the table shows the base's term first, then the tasks'
        row = next(line for line in table.splitlines() if line.startswith(f"scale={scale:g} "))
        terms = row.split()[2:]
        assert float(terms[0]) == pytest.approx(base, rel=1e-3) and terms[1] == "|"
        # held-out: the base's accuracy is part of the reported mean
        accuracies = [_accuracy(model, setup, rows) for rows in HELD_OUT.values()]
        accuracies.append(_accuracy(model, setup, BASE_HELD_OUT))
        assert point["base_validation"]["accuracy"] == accuracies[-1]
        scores.append(sum(accuracies) / 3)
    assert report["validation"]["best_score"] == max(scores)
    assert report["validation"]["chosen_score"] == scores[report["chosen_index"]]


def test_the_base_tasks_mismatch_is_against_the_base_model(
    setup,  # noqa: F811
    base_data,
    tmp_path,
    capsys,
):
    config = _config(setup, "ta.yaml", "task_arithmetic")
    out = tmp_path / "mm.json"
    flags = ["--scales", "0.5", "--criterion", "mismatch", "--base-data", base_data, "--out", out]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _tune(setup, config, *flags) == 0
    messages = [str(w.message) for w in caught if issubclass(w.category, SelectionWarning)]
    assert len(messages) == 1  # a one-point grid has no edge
    assert messages[0].startswith("--criterion mismatch is a diagnostic, not a way to choose")
    (point,) = json.loads(out.read_text())["points"]
    merged = _load(setup, _task_arithmetic(setup, 0.5))
    base_model = _load(setup, _weights(setup / "base"))
    g, g0 = _gradient(merged, setup, BASE), _gradient(base_model, setup, BASE)
    norm = math.sqrt(sum(float(((g[k] - g0[k]) ** 2).sum()) for k in g))
    assert math.isclose(point["base"]["term"], norm / len(BASE), rel_tol=1e-8)
    total = point["base"]["term"] + sum(task["term"] for task in point["tasks"])
    assert math.isclose(point["criterion"], total, rel_tol=1e-12)


def test_a_choice_on_the_grids_edge_warns_and_is_recorded(setup, tmp_path, capsys):  # noqa: F811
    config = _config(setup, "ta.yaml", "task_arithmetic")
    out = tmp_path / "edge.json"
    with pytest.warns(SelectionWarning) as caught:
        assert _tune(setup, config, "--scales", "0.5,1", "--out", out) == 0  # two points: an edge
    report = json.loads(out.read_text())
    side = "lowest" if report["chosen_index"] == 0 else "highest"
    assert report["at_grid_edge"] is True
    assert report["grid_edges"] == [
        {"axis": "scale", "side": side, "value": report["chosen"]["scale"], "flag": "--scales"}
    ]
    (warning,) = caught
    assert str(warning.message).startswith(f"the chosen setting is at the {side} scale of the grid")
    assert f"at the {side} scale of the grid" in capsys.readouterr().out  # the `chosen:` line
    # a one-point grid has no edge to speak of
    with warnings.catch_warnings():
        warnings.simplefilter("error", SelectionWarning)
        assert _tune(setup, config, "--scales", "1", "--out", tmp_path / "one.json") == 0
    assert json.loads((tmp_path / "one.json").read_text())["at_grid_edge"] is False


def test_the_command_prints_each_warning_on_one_line(setup, tmp_path):  # noqa: F811
    config = _config(setup, "ta.yaml", "task_arithmetic")
    argv = [sys.executable, "-m", "gradmerge", "tune", str(config), str(setup / "a.jsonl")]
    argv += [str(setup / "b.jsonl"), "--scales", "0.5,1", "--criterion", "mismatch"]
    done = subprocess.run([*argv, "--no-progress"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "warning" in line]
    assert [line.split(": ")[1] for line in lines] == ["warning", "warning"], done.stderr
    assert lines[0].startswith("gradmerge tune: warning: --criterion mismatch is a diagnostic")
    assert lines[1].startswith("gradmerge tune: warning: the chosen setting is at the")
    assert ".py:" not in done.stderr and "warnings.warn" not in done.stderr


# ----- the library ----------------------------------------------------------------------------
AXIS_VALUES = st.lists(
    st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.0]), min_size=1, max_size=3, unique=True
)


@given(
    scales=AXIS_VALUES,
    deltas=AXIS_VALUES.filter(lambda v: 0.0 not in v),
    data=st.data(),
)
def test_grid_edges_names_each_axis_whose_extreme_holds_the_choice(scales, deltas, data):
    points = [Setting(s, d) for s in scales for d in deltas]
    criteria = data.draw(
        st.lists(st.one_of(st.none(), st.floats(0, 10)), min_size=len(points), max_size=len(points))
    )
    scored = [p for p, c in zip(points, criteria, strict=True) if c is not None]
    if not scored:
        return
    chosen = points.index(data.draw(st.sampled_from(scored)))
    expected = []
    for axis, flag in (("scale", "--scales"), ("delta", "--deltas")):
        values = sorted({getattr(p, axis) for p in scored})
        value = getattr(points[chosen], axis)
        if len(values) >= 2 and value == values[-1]:
            expected.append({"axis": axis, "side": "highest", "value": value, "flag": flag})
        elif len(values) >= 2 and value == values[0] and value > 0:
            expected.append({"axis": axis, "side": "lowest", "value": value, "flag": flag})
    assert grid_edges(points, criteria, chosen) == expected
