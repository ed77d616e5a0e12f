"""benchmarks/tune_criteria.py at its quick size: every choice (and the validation-best α) is the
least point of its curve, each regret is ≥ 0, and the base task adds a positive term."""

from __future__ import annotations

from benchmarks import tune_criteria
from benchmarks.record import read_result


def test_each_choice_is_its_criterions_least_point(tmp_path):
    out = tmp_path / "q.json"
    assert tune_criteria.main(["--quick", "--out", str(out)]) == 0
    body = read_result(out)["results"]
    grid = body["grid"]
    assert [row["model"] for row in body["rows"]] == ["softmax regression"] * 2 + ["MLP on digits"]
    for row in body["rows"]:
        curves = row["curves"]
        assert (
            row["validation-best alpha"]
            == grid[curves["validation"].index(min(curves["validation"]))]
        )
        for name in tune_criteria.CRITERIA:
            assert row["chosen alpha"][name] == grid[curves[name].index(min(curves[name]))]
            assert row["held-out loss above the best"][name] >= 0
        if row["model"] == "MLP on digits":
            best = max(curves["accuracy"])
            for name, i in row["held-out accuracy below the best (points)"].items():
                chosen = curves["accuracy"][grid.index(row["chosen alpha"][name])]
                assert i == 100 * (best - chosen) >= 0
        # the loss with the base is the loss without it plus one positive term
        gaps = [
            a - b
            for a, b in zip(
                curves["loss with the base"], curves["loss without the base"], strict=True
            )
        ]
        assert all(g > 0 for g in gaps)
