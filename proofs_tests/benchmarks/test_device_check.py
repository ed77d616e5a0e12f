"""python -m benchmarks.device_check --quick: the GPU check's CPU mode runs here, so the one command
to run first on a GPU cannot rot. Every step must succeed at toy size, the JSON must name the
device, and the K-FAC merge must be certified (float32 default tolerance)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from benchmarks.inprocess import restored_state, run_cli
from benchmarks.record import read_result


def in_process(cmd: list[str], timeout: float) -> dict[str, object]:
    """``device_check.run`` for ``python -m gradmerge ARGS``, run in this process
    (:func:`benchmarks.inprocess.run_cli`; ``curvature`` and ``merge`` have their subprocess
    smokes elsewhere): wall seconds, return code, the output's tail."""
    assert cmd[:3] == [sys.executable, "-m", "gradmerge"], cmd
    start = time.perf_counter()  # reported (gb_per_second), never compared with a bound
    done = run_cli(cmd[3:])
    return {
        "wall_seconds": time.perf_counter() - start,
        "returncode": done.returncode,
        "tail": (done.stdout + done.stderr)[-2000:],
    }


def test_quick_mode_runs_every_step_and_names_the_device(tmp_path, monkeypatch):
    """The check's own code in this process, its ``gradmerge`` commands too (their imports paid
    once per suite)."""
    from benchmarks import device_check

    monkeypatch.setattr(device_check, "run", in_process)
    out = tmp_path / "check.json"
    with restored_state():
        assert device_check.main(["--quick", "--out", str(out)]) == 0
    record = read_result(out)  # the suite's record, validated
    assert record["benchmark"] == "device_check" and record["results"]["complete"] is True
    report = record["results"]
    assert report["mode"] == "quick" and report["device_kind"] == "cpu"
    assert report["device"].startswith("cpu: ") and len(report["device"]) > len("cpu: ")
    assert set(report["steps"]) == {"tests", "kfac", "diagonal"} and report["ok"] is True
    tests, kfac, diagonal = (report["steps"][k] for k in ("tests", "kfac", "diagonal"))
    assert tests["returncode"] == 0 and all("::test_" in t for t in tests["tests"])
    assert kfac["merge"]["returncode"] == 0 and 0 < kfac["max_residual"] <= 1e-5
    assert kfac["estimate_task0"]["returncode"] == kfac["estimate_task1"]["returncode"] == 0
    assert diagonal["returncode"] == 0 and diagonal["parameters"] > 0
    assert diagonal["gb_per_second"] > 0


def test_quick_mode_never_writes_into_the_committed_results(monkeypatch, capsys):
    """Without --out, --quick writes its record into a temporary folder: benchmarks/results/
    holds the same files, byte for byte, before and after (the steps stubbed: only where the
    record goes is under test; the real steps run above)."""
    from benchmarks import device_check
    from benchmarks.record import RESULTS

    before = {p.name: p.read_bytes() for p in RESULTS.iterdir()}
    for step in ("step_tests", "step_kfac", "step_diagonal"):
        monkeypatch.setattr(device_check, step, lambda *_: {"returncode": 0})
    assert device_check.main(["--quick"]) == 0
    assert {p.name: p.read_bytes() for p in RESULTS.iterdir()} == before
    written = Path(capsys.readouterr().out.split("wrote ")[-1].split(" (")[0])
    assert RESULTS not in written.parents and read_result(written)["results"]["ok"] is True
    assert device_check.default_out(quick=False).parent == RESULTS
