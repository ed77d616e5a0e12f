"""`gradmerge tune --task-heads GLOB`: tasks with their own heads over one merged body.

References computed here, without gradmerge's merge or evaluation code: the merged body by hand
(task arithmetic, the head passed through from the base), task t's head copied from its own
fine-tune, HF's cross-entropy one example at a time (the fixtures of test_tune_command.py).
"""

from __future__ import annotations

import json
import math

import torch

from proofs_tests.commands.test_tune_command import (
    TASKS,
    _config,
    _load,
    _mean_loss,
    _task_arithmetic,
    _tune,
    _weights,
    setup,  # noqa: F401 (the module's fixture)
)

HEAD = ("classifier.weight", "classifier.bias")


def test_each_task_is_scored_with_its_own_head(setup, tmp_path):  # noqa: F811
    config = _config(setup, "heads.yaml", "task_arithmetic", passthrough=["classifier.*"])
    scales = [0.5, 1.0]
    out = tmp_path / "tune.json"
    grid = ",".join(map(str, scales))
    flags = ["--scales", grid, "--out", out, "--task-heads", "classifier.*"]
    assert _tune(setup, config, *flags) == 0
    report = json.loads(out.read_text())
    base = _weights(setup / "base")
    for point, scale in zip(report["points"], scales, strict=True):
        merged = _task_arithmetic(setup, scale) | {k: base[k] for k in HEAD}
        total = 0.0
        for task, entry in zip(TASKS, point["tasks"], strict=True):
            own = _weights(setup / f"ft-{task}")
            loss = _mean_loss(_load(setup, merged | {k: own[k] for k in HEAD}), setup, task)
            assert math.isclose(entry["mean_loss"], loss, rel_tol=1e-9), (scale, task)
            total += loss
        assert math.isclose(point["criterion"], total, rel_tol=1e-9)
    # without the flag every task reads the merged (here: the base's) head: other losses
    plain = tmp_path / "plain.json"
    assert _tune(setup, config, "--scales", grid, "--out", plain) == 0
    assert (
        json.loads(plain.read_text())["points"][0]["criterion"] != report["points"][0]["criterion"]
    )


def test_a_glob_that_matches_nothing_is_an_error(setup, tmp_path, capsys):  # noqa: F811
    config = _config(setup, "heads.yaml", "task_arithmetic", passthrough=["classifier.*"])
    flags = ["--scales", "1", "--out", tmp_path / "o.json", "--task-heads", "head.*"]
    assert _tune(setup, config, *flags) == 1
    assert "every setting failed" in capsys.readouterr().err
    (point,) = json.loads((tmp_path / "o.json").read_text())["points"]  # the point's error
    assert "--task-heads head.* matches no parameter" in point["error"]
    assert point["criterion"] is None


def test_the_base_task_is_scored_with_the_base_models_head(setup, tmp_path):  # noqa: F811
    from proofs_tests.commands.test_tune_base_and_edges import BASE, _write

    config = _config(setup, "merged-heads.yaml", "task_arithmetic")  # heads merged too
    out = tmp_path / "tune.json"
    base_data = _write(tmp_path / "base.jsonl", BASE)
    flags = [
        "--scales",
        "1",
        "--out",
        out,
        "--task-heads",
        "classifier.*",
        "--base-data",
        base_data,
    ]
    assert _tune(setup, config, *flags) == 0
    (point,) = json.loads(out.read_text())["points"]
    merged, base = _task_arithmetic(setup, 1.0), _weights(setup / "base")
    assert not all(torch.equal(merged[k], base[k]) for k in HEAD)  # the merged head is another
    loss = _mean_loss(_load(setup, merged | {k: base[k] for k in HEAD}), setup, BASE)
    assert math.isclose(point["base"]["term"], loss, rel_tol=1e-9)
