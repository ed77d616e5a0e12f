"""Inputs that change while a run reads them (issue 29, item 5).

A merge records the size and modification time of every input file before it opens them
(:class:`gradmerge.foundation.guard.Snapshot`) and checks them again before the output folder is
renamed into place: an input rewritten or appended to mid-merge is an :class:`InputChangedError` and
OUT_DIR is not created. A shard truncated while memory-mapped, with parts still to read, kills
the process (SIGBUS) before that check (docs/reliability.md states the limit); OUT_DIR is not
created then either, which a killed process shows. Truncated after its last read, it is a change.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import save_file

import gradmerge as gm
from gradmerge import cli
from gradmerge.io import writer


@pytest.fixture
def folder(tmp_path):
    save_file({"w": torch.zeros(64), "v": torch.zeros(64)}, tmp_path / "base.safetensors")
    save_file({"w": torch.ones(64), "v": torch.ones(64)}, tmp_path / "ft.safetensors")
    config = {
        "method": "task_arithmetic",
        "base_model": "base.safetensors",
        "models": [{"model": "ft.safetensors"}],
    }
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(config))
    return tmp_path


@pytest.mark.parametrize("change", ["append", "rewrite", "remove"])
def test_an_input_changed_mid_merge_writes_nothing(folder, capsys, monkeypatch, change):
    original = writer.ShardedWriter.write
    done = []

    def write_and_change(self, name, tensor):
        if not done:  # after the inputs were opened, before the output is published
            target = folder / "ft.safetensors"
            if change == "append":
                with open(target, "ab") as handle:
                    handle.write(b" " * 8)
            elif change == "rewrite":
                save_file({"w": 2 * torch.ones(64), "v": torch.ones(64)}, target)
                os.utime(target, ns=(0, 10**9))  # a rewrite of the same size, another time
            else:
                target.unlink()
            done.append(1)
        return original(self, name, tensor)

    monkeypatch.setattr(writer.ShardedWriter, "write", write_and_change)
    out = folder / "out"
    assert cli.main(["merge", str(folder / "m.yaml"), str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"models[0].model {folder / 'ft.safetensors'} changed while the run read it" in err
    assert err.count("\n") == 1 and not out.exists()
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []
    save_file({"w": torch.ones(64), "v": torch.ones(64)}, folder / "ft.safetensors")  # whole again
    done.clear()
    with pytest.raises(gm.InputChangedError):
        gm.run_merge(gm.MergeConfig.from_yaml(folder / "m.yaml"), out, progress=False)
    assert not out.exists()


TRUNCATING = """
import sys, torch
from gradmerge.io import writer
original = writer.ShardedWriter.write
calls = []
def write(self, name, tensor):
    calls.append(name)
    if len(calls) == {at}:
        open({shard!r}, "r+b").truncate(1024)  # the data are gone
    return original(self, name, tensor)
writer.ShardedWriter.write = write
from gradmerge.cli import main
sys.exit(main(["merge", {config!r}, {out!r}, "--no-progress"]))
"""
NAMES = [f"t{i}" for i in range(8)]


def truncating_merge(folder, at):
    """Run the CLI merge in a child process whose ``at``-th output write truncates the shard."""
    save_file({n: torch.ones(2**20) for n in NAMES}, folder / "ft.safetensors")
    save_file({n: torch.zeros(2**20) for n in NAMES}, folder / "base.safetensors")
    script = TRUNCATING.format(
        at=at,
        shard=str(folder / "ft.safetensors"),
        config=str(folder / "m.yaml"),
        out=str(folder / "out"),
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)


def test_a_shard_truncated_while_mapped_kills_the_run_and_out_is_not_created(folder):
    """The limit docs/reliability.md states: reading a truncated memory-mapped shard raises
    SIGBUS, which no check can turn into an error; the output still does not appear. The
    truncation comes at the first write; outputs are written at most
    ``engine.WRITES_PENDING`` steps behind the reads, so later steps still read the shard."""
    done = truncating_merge(folder, at=1)
    assert done.returncode == -signal.SIGBUS, done.stderr  # killed: no error message is possible
    assert not (folder / "out").exists()


def test_a_shard_truncated_after_its_last_read_is_a_change(folder):
    """Outputs are written behind the reads: a truncation at the last write comes after every
    read of the shard, so the process lives and the check before publishing names the change."""
    done = truncating_merge(folder, at=len(NAMES))
    assert done.returncode == 1, done.stderr
    shard = folder / "ft.safetensors"
    assert f"models[0].model {shard} changed while the run read it" in done.stderr
    assert "-> 1,024 bytes" in done.stderr and not (folder / "out").exists()


def test_the_configuration_edited_mid_merge_is_not_a_change(folder, capsys, monkeypatch):
    """The YAML was read once, before the merge: editing it afterwards changes nothing read."""
    original = writer.ShardedWriter.write

    def write_and_edit(self, name, tensor):
        with open(folder / "m.yaml", "a") as handle:
            handle.write("# edited\n")
        return original(self, name, tensor)

    monkeypatch.setattr(writer.ShardedWriter, "write", write_and_edit)
    assert cli.main(["merge", str(folder / "m.yaml"), str(folder / "out"), "--no-progress"]) == 0
    assert (folder / "out" / "model.safetensors").is_file()
