"""benchmarks.scale: the smoke run writes a valid record with its fits, and the K-FAC calibration
predicts for each arithmetic the tolerance record measured (and only those)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.record import read_result
from benchmarks.scale import calibrate
from proofs_tests.limits import HANG_S

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale") / "scale.json"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.scale", "--quick", "--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=HANG_S,
    )
    return read_result(out)


def test_the_smoke_run_is_a_record_with_the_fits_and_predictions(quick):
    results = quick["results"]
    assert quick["benchmark"] == "scale" and quick["settings"]["quick"] is True
    assert {"estimation", "merge", "predictions"} <= set(results)
    rates = results["fits"]["kfac_layer"]["rates"]
    assert all(v > 0 for v in rates.values())
    checks = results["fits"]["kfac_layer"]["checks_against_whole_solves"]
    assert checks and all(c["cg_iterations"] >= 0 and c["measured_seconds"] > 0 for c in checks)


def _row(setting, wall, iterations):
    return {"setting": setting, "wall_seconds": wall, "cg_iterations": iterations, "returncode": 0}


@pytest.mark.parametrize(
    ("rows", "arithmetics"),
    [
        ([_row("tol=1e-05, bfloat16 products", 220.0, 1554)], ["bfloat16"]),
        (
            [
                _row("tol=1e-05, float32 products", 400.0, 1338),
                _row("tol=1e-05, bfloat16 products", 220.0, 1554),
            ],
            ["bfloat16", "float32"],
        ),
    ],
)
def test_calibration_predicts_for_the_arithmetics_measured(quick, rows, arithmetics):
    measured = {"rows": [_row("approximate maxiter=0", 142.0, 0), *rows]}
    out = calibrate(quick["results"], measured, "tolerance.json")
    assert out["gpt2_124m_measured_fixed_seconds"] == 142.0
    assert sorted(out["per_iteration"]) == arithmetics
    for label in arithmetics:
        factor = out["per_iteration"][label]
        wall = next(r for r in rows if label in r["setting"])
        per = (wall["wall_seconds"] - 142.0) / wall["cg_iterations"]
        assert factor["measured_seconds_per_layer_iteration"] == pytest.approx(per)
        for model in ("llama-7b", "llama-70b"):
            assert out[model][label]["cpu_seconds_2_cores"] > 0
