"""`merge --dry-run` names the least δ in a handful of solves wherever the configured δ lies.

The case of the issue: `prior: {delta: 1.0e-30}` with K-FAC curvatures estimated from a few
examples (rank-deficient factors: singular at any δ below the round-off floor). The dry run used
to bisect from the configured δ (each try one full solve of the unit), so the solves it spent
grew with how far below the answer the configuration started. It now starts from the solver's
own bound (the error's ``suggested_delta``) and goes down only until a value fails.

Measured by a COUNT of solves (a spy on ``Job.compute_unit``), never by time; the δ it names is
checked against the real run: the named value merges, the value it found failing below refuses.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import yaml

from gradmerge.cli import main
from gradmerge.jobs.job import Job
from proofs_tests.workspace import make_workspace

SOLVES = 8
"""At most this many solves of a refused unit: the refusal as configured, then the search."""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("search"), "kfac")


def _config(ws, delta, dtype):
    path = ws.root / f"gm-{delta:g}-{dtype}.yaml"
    path.write_text(yaml.safe_dump(ws.merge_dict(prior={"delta": delta}, compute_dtype=dtype)))
    return path


def _dry_run(ws, delta, dtype, monkeypatch, capsys):
    """The dry run's exit code, output and solves per unit (by its first key)."""
    solves: Counter[str] = Counter()
    real = Job.compute_unit

    def counted(self, unit, *args, **kwargs):
        solves[unit.keys[0]] += 1
        return real(self, unit, *args, **kwargs)

    monkeypatch.setattr(Job, "compute_unit", counted)
    capsys.readouterr()
    code = main(["merge", str(_config(ws, delta, dtype)), str(ws.root / "out"), "--dry-run",
                 "--no-progress"])  # fmt: skip
    monkeypatch.undo()
    return code, capsys.readouterr().out, solves


STARTS = [("float32", 1e-30), ("float32", 1e-36), ("float32", 1e-20), ("float64", 1e-30),
          ("float64", 1e-300)]  # fmt: skip


@pytest.mark.parametrize(("dtype", "delta"), STARTS, ids=[f"{d}-{x:g}" for d, x in STARTS])
def test_the_dry_run_names_the_delta_in_a_handful_of_solves(workspace, monkeypatch, capsys,
                                                            dtype, delta):  # fmt: skip
    code, out, solves = _dry_run(workspace, delta, dtype, monkeypatch, capsys)
    assert code == 1
    refused = re.findall(r"\['([^']+)'.*finite and certified from δ = ([0-9.e+-]+) \(δ = "
                         r"([0-9.e+-]+) fails\)", out)  # fmt: skip
    assert refused, out
    for key, least, below in refused:
        assert solves[key] <= SOLVES, (key, solves)
        assert float(below) < float(least) <= 2 * float(below)  # a bracket within a factor 2
    # every unit the run solves as configured costs one solve
    assert all(n == 1 for key, n in solves.items() if key not in {k for k, _, _ in refused})


def test_the_count_does_not_depend_on_the_start_and_the_run_agrees(workspace, monkeypatch,
                                                                   capsys):  # fmt: skip
    counts, named = [], set()
    for delta in (1e-30, 1e-36, 1e-20):
        _, out, solves = _dry_run(workspace, delta, "float32", monkeypatch, capsys)
        counts.append(solves)
        named.add(re.search(r"set `prior: \{delta: \.\.\.\}` to at least ([0-9.e+-]+) ", out)[1])
    assert counts[0] == counts[1] == counts[2]
    assert len(named) == 1
    least = float(named.pop())
    found = re.search(r"\(δ = ([0-9.e+-]+) fails\)", out)
    below = float(found[1])
    # the real run: the named δ merges, the δ found failing below it refuses
    for value, expected in ((least, 0), (below, 1)):
        out_dir = workspace.root / f"run-{value:g}"
        assert main(["merge", str(_config(workspace, value, "float32")), str(out_dir),
                     "--no-progress"]) == expected  # fmt: skip
        capsys.readouterr()
