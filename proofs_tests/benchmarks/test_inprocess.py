"""benchmarks/inprocess.py: ``gradmerge`` run in this process gives what the executable gives.

The studies' ``--quick`` modes and the tutorial's test run their commands through
:func:`benchmarks.inprocess.run_cli`; here the same commands run both ways — each one also as a
real subprocess, ``python -m gradmerge ...`` (the one subprocess smoke of ``gradient``,
``inspect`` and ``evaluate``; ``curvature``, ``merge``, ``remove`` and ``tune`` have theirs in
their own tests too) — and must agree: exit status, stdout, stderr, and every file written (its
bytes; JSON without its wall-clock fields; safetensors as metadata and tensor bytes, the header's
key order being the writer's per-process hash order). Then the state a command changes (warning
filters, loggers, torch's threads and RNG, the environment) must be back as it was.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from benchmarks.inprocess import exit_status, run_cli
from proofs_tests.text_models import LABELS, WORDS, bert_classifier

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("inputs")
    bert_classifier(folder / "base", seed=0)
    bert_classifier(folder / "ft", seed=1)
    rng = random.Random(0)
    with open(folder / "data.jsonl", "w") as f:
        for _ in range(12):
            text = " ".join(rng.sample(WORDS, 5))
            f.write(json.dumps({"text": text, "label": rng.choice(LABELS)}) + "\n")
    return folder


def steps(inputs: Path, out: Path) -> list[list[str]]:
    """A chain of commands, each reading what the previous wrote, ending with two refusals."""
    (out / "gm.yaml").write_text(
        f"method: gradient_matching\nbase_model: {inputs / 'base'}\n"
        f"models:\n  - {{model: {inputs / 'ft'}, curvature: {out / 'c.safetensors'}}}\n"
        "prior: {delta: 0.01}\n"
    )
    data = str(inputs / "data.jsonl")
    return [
        ["curvature", str(inputs / "ft"), data, str(out / "c.safetensors"), "--structure", "diag",
         "--fisher", "mc", "--seed", "3", "--no-progress"],
        ["gradient", str(inputs / "ft"), data, str(out / "g.safetensors"), "--no-progress"],
        ["inspect", str(out / "c.safetensors"), "--json", str(out / "i.json")],
        ["merge", str(out / "gm.yaml"), str(out / "merged"), "--no-progress"],
        ["evaluate", str(inputs / "base"), str(out / "merged"), data, "--out",
         str(out / "e.json"), "--no-progress"],
        ["merge", str(out / "missing.yaml"), str(out / "m2")],  # a refusal: exit 1 or 2
        ["curvature", "--no-such-flag"],  # argparse: exit 2
    ]  # fmt: skip


def without_times(value: object) -> object:
    """A JSON value without the wall-clock and path fields that differ between two runs."""
    if isinstance(value, dict):
        return {
            k: without_times(v)
            for k, v in value.items()
            if not any(
                w in k for w in ("seconds", "time", "started", "finished", "elapsed", "created")
            )
        }
    if isinstance(value, list):
        return [without_times(v) for v in value]
    return value


def same(text: str, folder: Path) -> str:
    """Output as two runs share it: the folder named OUT, wall-clock seconds as N, no progress
    bars (their rates and redraws are timing; transformers draws one while loading)."""
    lines = re.split(r"[\r\n]+", text.replace(str(folder), "OUT"))
    kept = [line for line in lines if line and not re.search(r"\d+%\|", line)]
    return re.sub(r"\d+(\.\d+)? s\b", "N s", "\n".join(kept))


def files(folder: Path) -> dict[str, object]:
    found: dict[str, object] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix != ".yaml":
            name = str(path.relative_to(folder))
            if path.suffix == ".json":  # the folder's own path named OUT, as in ``same``
                text = path.read_text().replace(str(folder), "OUT")
                found[name] = without_times(json.loads(text))
            elif path.suffix == ".md":  # the model card names its folder
                found[name] = path.read_text().replace(str(folder), "OUT")
            elif path.suffix == ".safetensors":  # tensors' bytes and the metadata, as a dict:
                # the safetensors writer orders the header's metadata by a per-process hash
                with safe_open(path, "pt") as f:
                    meta = dict(f.metadata() or {})
                    tensors = {k: f.get_tensor(k).numpy().tobytes() for k in f.keys()}  # noqa: SIM118
                found[name] = (meta, tensors)
            else:
                found[name] = path.read_bytes()
    return found


SUBPROCESSES = """
import json, subprocess, sys
out = []
for argv in json.loads(sys.argv[1]):
    done = subprocess.run([sys.executable, "-m", "gradmerge", *argv], capture_output=True, text=True)
    out.append([done.returncode, done.stdout, done.stderr])
print(json.dumps(out))
"""


def test_in_process_equals_the_subprocess(inputs, tmp_path):
    here, there = tmp_path / "one", tmp_path / "two"  # names of one length: tables align alike
    here.mkdir()
    there.mkdir()
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    # the subprocess chain runs meanwhile in its own process, each command a `python -m gradmerge`
    chain = subprocess.Popen(
        [sys.executable, "-c", SUBPROCESSES, json.dumps(steps(inputs, there))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    mine = [run_cli(a, threads=1, env={"HF_HUB_OFFLINE": "1"}) for a in steps(inputs, here)]
    out, err = chain.communicate()
    assert chain.returncode == 0, err
    for a, m, (code, stdout, stderr) in zip(
        steps(inputs, here), mine, json.loads(out), strict=True
    ):
        what = " ".join(a[:2])
        assert m.returncode == code, (what, m.stderr, stderr)
        assert same(m.stdout, here) == same(stdout, there), what
        assert same(m.stderr, here) == same(stderr, there), what
    assert files(here) == files(there)
    assert {"c.safetensors", "g.safetensors", "i.json", "e.json"} <= set(files(here))
    assert (here / "merged" / "gradmerge_merge.json").is_file()


def test_the_state_a_command_changes_is_restored(inputs, tmp_path):
    warnings.simplefilter("ignore", DeprecationWarning)  # inside pytest's own catch_warnings
    filters = list(warnings.filters)
    loggers = {
        n: lg.level
        for n, lg in logging.Logger.manager.loggerDict.items()
        if isinstance(lg, logging.Logger)
    }
    threads, rng, cwd = torch.get_num_threads(), torch.get_rng_state(), os.getcwd()
    environ = dict(os.environ)
    done = run_cli(
        ["curvature", str(inputs / "ft"), str(inputs / "data.jsonl"),
         str(tmp_path / "c.safetensors"), "--structure", "kfac", "--no-progress"],
        threads=1 if threads > 1 else 2, env={"GRADMERGE_TEST_VARIABLE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert list(warnings.filters) == filters
    assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), rng)
    assert os.getcwd() == cwd and dict(os.environ) == environ
    after = {
        n: lg.level
        for n, lg in logging.Logger.manager.loggerDict.items()
        if isinstance(lg, logging.Logger)
    }
    assert {n: after[n] for n in loggers} == loggers


def test_exit_statuses_are_those_of_sys_exit(capsys):
    assert [exit_status(c) for c in (None, 0, 2, 7)] == [0, 0, 2, 7]
    assert exit_status("gradmerge: bad") == 1
    assert capsys.readouterr().err == "gradmerge: bad\n"
    done = run_cli(["merge"])  # argparse: missing arguments
    assert done.returncode == 2 and "usage: gradmerge merge" in done.stderr and not done.stdout
