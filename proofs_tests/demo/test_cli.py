"""``gradmerge demo``: outputs written (valid PNGs, the same numbers), bad --out refused, atomic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from matplotlib.image import imread

import gradmerge as gm
from gradmerge import cli
from gradmerge.demo import DemoResults, run_demo
from gradmerge.demo.plots import PLOTS

OUTPUTS = sorted(["results.json", "table.txt", *PLOTS])
PNG = b"\x89PNG\r\n\x1a\n"


def _comparable(results: dict) -> dict:
    """Everything but the wall-clock timings and the environment (equal for equal seeds)."""
    return {k: v for k, v in results.items() if k not in ("timings", "environment")}


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


@pytest.fixture
def no_study(monkeypatch):
    """Make any study fail loudly: the checks must come before the work."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the study ran although the output was unusable")

    monkeypatch.setattr("gradmerge.demo.study.run_study", forbidden)


@pytest.fixture
def cached_study(monkeypatch, quick_results):
    """The study replaced by the session's quick results (for the output-handling tests)."""
    monkeypatch.setattr("gradmerge.demo.study.run_study", lambda *a, **k: quick_results)


def test_cli_quick_run_writes_tables_json_and_pngs(tmp_path, capsys, quick_results: DemoResults):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--quick", "--out", str(out), "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "task arithmetic" in text and "grad. matching, full" in text and "Koh & Liang" in text
    assert sorted(p.name for p in out.iterdir()) == OUTPUTS
    assert _siblings(out) == []  # no temporary directory left behind
    written = json.loads((out / "results.json").read_text())
    # deterministic: the same seed gives the same numbers as the session's Python API run
    assert _comparable(written) == _comparable(json.loads(json.dumps(quick_results.to_dict())))
    assert (out / "table.txt").read_text().strip() == quick_results.summary().strip()
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG
        image = imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 500
        assert float(image[..., :3].std()) > 0.05  # something is drawn


def test_out_is_a_file(tmp_path, capsys, no_study):
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--quick", "--out", str(target)])
    assert exit_info.value.code == 2
    assert f"--out {target} is a file; give a folder name" in capsys.readouterr().err
    with pytest.raises(gm.OutputWriteError, match="is a file; give a folder name"):
        run_demo(target, quick=True, log=None)
    with pytest.raises(gm.OutputWriteError, match=f"{target} is a file, not a folder"):
        run_demo(target / "demo", quick=True, log=None)
    assert target.read_text() == "keep me"


def test_existing_out_needs_overwrite(tmp_path, capsys, no_study):
    out = tmp_path / "demo"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--quick", "--out", str(out)])
    assert exit_info.value.code == 2
    assert "--overwrite" in capsys.readouterr().err
    with pytest.raises(gm.OutputExistsError, match="exists; pass overwrite=True"):
        run_demo(out, quick=True, log=None)
    assert (out / "old.txt").read_text() == "old"


def _unwritable(tmp_path: Path) -> Path:
    """A directory nothing can be written in (a read-only one; /sys when running as root)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        (locked / "probe").mkdir()
    except OSError:
        return locked
    (locked / "probe").rmdir()
    locked.chmod(0o700)
    if Path("/sys").is_dir():  # as root, permissions do not stop a write; sysfs does
        probe = Path("/sys/gradmerge-probe")
        try:
            probe.mkdir()
        except OSError:
            return Path("/sys")
        probe.rmdir()
    pytest.skip("no unwritable directory available here")


def test_unwritable_out(tmp_path, capsys, no_study):
    out = _unwritable(tmp_path) / "demo"
    with pytest.raises(gm.OutputWriteError, match="could not be written"):
        run_demo(out, quick=True, log=None)
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--quick", "--out", str(out)])
    assert info.value.code == 2 and "could not be written" in capsys.readouterr().err
    assert not out.exists()


def test_overwrite_replaces_the_directory(tmp_path, cached_study):
    out = tmp_path / "demo"
    out.mkdir()
    (out / "stale.txt").write_text("stale")
    assert cli.main(["demo", "--quick", "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == OUTPUTS
    assert _siblings(out) == []


def test_a_failure_leaves_no_half_written_directory(tmp_path, monkeypatch, cached_study):
    def broken(results, directory):
        (directory / "accuracy_vs_alpha.png").write_bytes(PNG)  # half done, then
        raise RuntimeError("disk full")

    monkeypatch.setattr("gradmerge.demo.plots.write_plots", broken)
    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError, match="disk full"):
        run_demo(fresh, quick=True, log=None)
    assert not fresh.exists() and _siblings(fresh) == []

    kept = tmp_path / "kept"  # an existing directory survives a failed --overwrite intact
    kept.mkdir()
    (kept / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="disk full"):
        run_demo(kept, quick=True, overwrite=True, log=None)
    assert sorted(p.name for p in kept.iterdir()) == ["old.txt"]
    assert _siblings(kept) == []


def test_bad_arguments(capsys, no_study):
    for argv, message in (
        (["--seed", "-1"], "--seed must be 0 or more"),
        (["--threads", "0"], "--threads must be at least 1"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["demo", "--quick", *argv])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(gm.ArgumentError, match="device must be"):
        run_demo(quick=True, device="tpu", log=None)
    if not torch.cuda.is_available():
        with pytest.raises(gm.DeviceError, match="CUDA is not available"):
            run_demo(quick=True, device="cuda", log=None)
