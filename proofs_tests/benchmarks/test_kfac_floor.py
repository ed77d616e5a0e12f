"""benchmarks/kfac_floor.py at toy size (GPT-2 width 64, depth 2): every stage runs, the record
follows the suite's schema, and each ratio is its stage's seconds over forward+backward's."""

from __future__ import annotations

import pytest

from benchmarks.record import portable_commands, read_result


def test_every_stage_is_timed_against_forward_backward(tmp_path):
    pytest.importorskip("transformers")
    from benchmarks import kfac_floor

    out = tmp_path / "floor.json"
    argv = ["--quick", "--rounds", "1", "--cli", "--keep", str(tmp_path), "--out", str(out)]
    assert kfac_floor.main(argv) == 0
    record = read_result(out)
    command = portable_commands({"settings": record["settings"], "command": "--out " + str(out)})
    assert record["benchmark"] == "kfac_floor"
    assert record["command"].endswith(command["command"])  # the path as the record writes it
    results = record["results"]
    (row,) = results["rounds"]
    assert list(row) == [*kfac_floor.STAGES, "save", "cli"]
    assert results["tokens"] == 2 * 16  # the quick inputs: 2 sequences of 16 tokens
    for which in ("cpu", "wall"):
        ratios = results[f"median_ratio_{which}"]
        assert ratios["forward_backward"] == 1.0
        fb = row["forward_backward"][which]
        for name, seconds in row.items():
            assert seconds[which] > 0
            assert ratios[name] == pytest.approx(seconds[which] / fb)
