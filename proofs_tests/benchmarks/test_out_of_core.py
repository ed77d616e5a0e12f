"""benchmarks/out_of_core.py at toy size: the out-of-core benchmark runs end to end (build the
inputs, evict them, read them once, merge through the CLI while sampling /proc, compare the
output with the in-memory gm.* rule, clean up), so that the full-size run cannot rot. Checked:
every measurement is present and consistent, every merged tensor equals the in-memory rule
bit for bit, nothing generated is left behind, and a run that would fill the disk refuses to
start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.out_of_core import MIN_FREE_GB, SIZES
from benchmarks.record import read_result
from proofs_tests.limits import HANG_S

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "benchmarks.out_of_core", "--size", "tiny", *args]
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S, check=False
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_the_tiny_run_measures_and_checks_both_merges(tmp_path):
    work, out = tmp_path / "work", tmp_path / "report.json"
    # --min-free-gb 0: the verdict must not depend on the disk's free space (the run writes a
    # few MB); the default margin is checked below, the refusal by the next test
    done = _run("--work", str(work), "--out", str(out), "--min-free-gb", "0")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = read_result(out)  # the suite's record
    assert record["benchmark"] == "out_of_core" and record["settings"]["size"] == "tiny"
    assert record["settings"]["min_free_gb"] == 0  # as given
    # by default the tiny run (a few MB) asks for 0.5 GB left free, not the full run's 10 GB
    assert MIN_FREE_GB == {"3b": 10.0, "tiny": 0.5}
    report, machine = record["results"], record["machine"]
    shapes = SIZES["tiny"]
    assert report["parameters"] == shapes.parameters() and report["tasks"] == 3
    assert machine["memory_bytes"] > 0 and machine["cpus"] >= 1
    assert report["disk"]["removed"] and list(work.iterdir()) == []  # everything cleaned up
    idle = report["idle_process"]
    assert idle["returncode"] == 0 and idle["peak_rss_anon_bytes"] > 0
    build = report["build"]
    assert set(report["merges"]) == {"gradient_matching", "task_arithmetic"}
    files = {"gradient_matching": 7, "task_arithmetic": 4}  # base, 3 models (, 3 curvatures)
    for method, row in report["merges"].items():
        merge, once = row["merge"], row["read_once"]
        assert merge["returncode"] == 0 and merge["samples"] >= 1
        # what is sampled: anonymous memory is part of VmRSS, and VmHWM is the peak of VmRSS
        assert 0 < merge["peak_rss_anon_bytes"] <= merge["peak_vm_rss_bytes"]
        assert merge["peak_vm_rss_bytes"] <= merge["vm_hwm_bytes"]
        assert row["peak_rss_anon_gib"] == merge["peak_rss_anon_bytes"] / 2**30 < 1
        assert row["input_files"] == files[method] and once["bytes"] == row["input_bytes"]
        assert row["input_bytes"] <= build["bytes"]
        assert row["inputs_over_ram"] == row["input_bytes"] / machine["memory_bytes"]
        assert once["seconds"] > 0 and merge["wall_seconds"] > 0
        assert row["wall_over_read_once"] == merge["wall_seconds"] / once["seconds"]
        again = row["read_once_after_merge"]  # the same read, after the merge
        assert again["bytes"] == once["bytes"] and again["seconds"] > 0
        assert row["wall_over_read_once_after_merge"] == merge["wall_seconds"] / again["seconds"]
        assert merge["cpu_seconds"] > 0  # the child's user + system time, from getrusage
        phases = {"before_read", "before_merge", "after_merge", "after_second_read"}
        assert set(row["load_average"]) == phases
        assert all(len(v) == 3 and min(v) >= 0 for v in row["load_average"].values())
        assert 0 <= row["cached_fraction_before_merge"] <= 1
        # bfloat16 output of 2 bytes per parameter, plus the shards' headers
        assert 2 * shapes.parameters() < row["output_bytes"] < 2 * shapes.parameters() + 2**16
        check = row["check"]
        assert check["ok"] and check["differing"] == []
        assert check["missing_or_wrong_shape_or_dtype"] == []
        assert sorted(check["compared"]) == sorted(shapes.tensors())  # every tensor compared


def test_a_run_that_would_fill_the_disk_refuses_to_start(tmp_path):
    work = tmp_path / "work"
    done = _run("--work", str(work), "--min-free-gb", "1e12", "--out", str(tmp_path / "r.json"))
    assert done.returncode != 0 and "refusing to start" in done.stderr
    assert not (tmp_path / "r.json").exists() and list(work.iterdir()) == []
