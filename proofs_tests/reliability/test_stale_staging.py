"""Issue 13, case 6: a merge killed with SIGKILL leaves its hidden staging folder
(``OUT/../.OUT.gradmerge-*``); the next run into OUT removes it — only once its owning process is
gone — and says so. Folders of running processes are not touched; folders whose owner cannot be
known are left and reported."""

import os
import signal
import subprocess
import sys

from gradmerge import cli
from gradmerge.foundation.files import temp_dir_beside
from gradmerge.jobs import MergeConfig, run_merge
from proofs_tests.limits import HANG_S
from proofs_tests.workspace import make_workspace

KILLED_MID_MERGE = """
import os, signal, sys
from gradmerge.jobs import MergeConfig
from gradmerge.io import writer

real = writer.ShardedWriter.write
def write_then_die(self, name, tensor):
    real(self, name, tensor)
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 after the first tensor is on disk
writer.ShardedWriter.write = write_then_die
from gradmerge.jobs import engine
engine.ShardedWriter = writer.ShardedWriter
engine.run_merge(MergeConfig.from_yaml(sys.argv[1]), sys.argv[2], progress=False)
"""


def _stages(out):
    return sorted(p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.gradmerge-"))


def test_case6_stale_staging_folder_of_a_killed_merge_is_removed_and_reported(tmp_path, capsys):
    ws = make_workspace(tmp_path / "ws", "diag")
    config = {
        "method": "task_arithmetic",
        "base_model": "base.safetensors",
        "models": [{"model": m.name} for m in ws.models],
    }
    path = ws.yaml("ta.yaml", config)
    out = tmp_path / "merged"
    child = subprocess.run(
        [sys.executable, "-c", KILLED_MID_MERGE, str(path), str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=HANG_S,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    (stale,) = _stages(out)
    assert any(stale.iterdir()) and not out.exists()

    # a folder of this (running) process and one without an owner in its name
    live = temp_dir_beside(out, "gradmerge")
    unknown = out.parent / f".{out.name}.gradmerge-x1y2z3"
    unknown.mkdir()

    assert cli.main(["merge", str(path), str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert f"removed {stale.name}, a staging folder left by a run that was killed" in text
    assert f"left {unknown.name} in place" in text and live.name not in text
    assert not stale.exists() and live.is_dir() and unknown.is_dir()
    assert (out / "model.safetensors").is_file()

    # Python callers get the same in the report
    report = run_merge(MergeConfig.from_yaml(path), out, overwrite=True, progress=False)
    assert report.stale_removed == () and report.stale_left == (unknown,)
