"""benchmarks/ as one suite: the record every results file holds (``benchmarks.record``), written
whole or not at all, and the committed results and scripts checked against it.

Every committed results file must be a record; benchmarks/README.md must name each and say for
each figure's file that a record holds it."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import stat
from pathlib import Path

import pytest

from benchmarks import record as R

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"


def _record(**changes):
    rec = R.Run("example", settings={"n": 3}, argv=["--n", "3"]).finish({"answer": 42})
    rec.update(changes)
    return rec


def test_a_finished_run_is_a_valid_record_naming_its_command_tree_machine_and_load():
    rec = _record()
    assert R.problems(rec) == []
    assert list(rec) == list(R.KEYS)
    assert rec["command"] == "python -m benchmarks.example --n 3"
    assert rec["settings"] == {"n": 3} and rec["results"] == {"answer": 42}
    assert set(R.MACHINE_KEYS) <= set(rec["machine"])
    assert rec["machine"]["cpus"] >= 1 and isinstance(rec["machine"]["torch"], str)
    assert len(rec["load"]["before"]) == len(rec["load"]["after"]) == 3
    assert re.fullmatch(r"[0-9a-f]{40}", rec["git"]["commit"])  # the suite runs in a checkout
    assert isinstance(rec["git"]["dirty"], bool)


def test_the_command_is_quoted_as_a_shell_takes_it():
    assert (
        R.command("merge", ["--out", "a b.json"]) == "python -m benchmarks.merge --out 'a b.json'"
    )


# each case: (what is changed, the words its problem must contain)
BAD = [
    (lambda r: r.pop("command"), "missing keys ['command']"),
    (lambda r: r.update({"load average at the end": 3.0}), "unexpected top-level keys"),
    (lambda r: r.update(schema="gradmerge-benchmark/0"), "schema is"),
    (
        lambda r: r.update(benchmark="tune criteria", command="python -m benchmarks.tune criteria"),
        "benchmark must be a module name",
    ),
    (lambda r: r.update(command="python benchmarks/example.py"), "command must start with"),
    (lambda r: r.update(git="36d4f0a"), "git must be"),
    (lambda r: r["machine"].pop("gpu"), "machine lacks ['gpu']"),
    (lambda r: r.update(load={"before": [1.0], "after": [1.0, 2.0, 3.0]}), "load must hold"),
    (lambda r: r.update(seconds=-1), "seconds must be"),
    (lambda r: r.update(settings=["--quick"]), "settings must be an object"),
    (lambda r: r.update(results=3.5), "results must be an object or a list"),
]


@pytest.mark.parametrize(("change", "words"), BAD)
def test_each_departure_from_the_schema_is_named(change, words):
    rec = _record()
    change(rec)
    found = R.problems(rec)
    assert len(found) == 1 and words in found[0], found
    with pytest.raises(R.RecordError, match=re.escape(words)):
        R.validate(rec)


def test_write_result_writes_whole_records_and_leaves_the_old_file_on_refusal(tmp_path):
    path = tmp_path / "sub" / "r.json"
    good = _record()
    assert R.write_result(path, good) == path
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # readable like any other file
    assert R.read_result(path) == json.loads(json.dumps(good))
    before = path.read_bytes()
    bad = copy.deepcopy(good)
    del bad["machine"]
    with pytest.raises(R.RecordError, match="missing keys \\['machine'\\]"):
        R.write_result(path, bad)
    with pytest.raises(ValueError, match="Out of range float"):
        R.write_result(path, _record(results={"ratio": math.nan}))
    assert path.read_bytes() == before  # neither refusal touched the file ...
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.json"]  # ... or left a temporary


def test_write_result_writes_the_plot_beside_the_record_or_neither(tmp_path):
    path = tmp_path / "study.json"
    drawn = []

    def figure(target):
        drawn.append(target)
        target.write_bytes(b"PNG " + str(len(drawn)).encode())

    good = _record()
    R.write_result(path, good, figure=figure)
    assert drawn[0].suffix == ".png" and drawn[0].parent == tmp_path  # matplotlib's format
    assert (tmp_path / "study.png").read_bytes() == b"PNG 1"
    assert R.read_result(path) == json.loads(json.dumps(good))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "study.png").stat().st_mode) == 0o666 & ~umask
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def broken(target):
        target.write_bytes(b"half a plot")
        raise RuntimeError("the plot failed")

    with pytest.raises(RuntimeError, match="the plot failed"):
        R.write_result(path, _record(results={"answer": 43}), figure=broken)
    with pytest.raises(ValueError, match="Out of range float"):  # refused before drawing
        R.write_result(path, _record(results={"ratio": math.inf}), figure=figure)
    assert len(drawn) == 1
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing touched


def test_read_result_names_the_file_that_is_not_a_record(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"machine": "x", "rows": []}))
    with pytest.raises(R.RecordError, match=r"old\.json: not a benchmark record: missing keys"):
        R.read_result(path)
    path.write_text("{")
    with pytest.raises(R.RecordError, match=r"old\.json: not JSON"):
        R.read_result(path)


RESULT_FILES = sorted(p.name for p in RESULTS.glob("*.json"))


@pytest.mark.parametrize("name", RESULT_FILES)
def test_every_results_file_is_a_record(name):
    found = R.problems(json.loads((RESULTS / name).read_text()))
    assert found == [], f"{name}: {found}"


def test_every_results_file_is_named_in_the_benchmarks_readme_and_every_named_one_exists():
    readme = (BENCHMARKS / "README.md").read_text()
    named = set(re.findall(r"results/([\w.-]+\.(?:json|png))", readme))
    present = {p.name for p in RESULTS.iterdir() if p.suffix in (".json", ".png")}
    assert sorted(present - named) == [], "results files the README does not name"
    assert sorted(named - present) == [], "files the README names that are not in results/"


# scripts other work is changing now; their owners move them to `python -m benchmarks.<name>`
NOT_YET_MODULES: set[str] = set()
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_is_a_module_of_the_suite(name):
    text = (BENCHMARKS / name).read_text()
    old = [hit for hit in ("sys.path.insert", "python benchmarks/", "__file__, ") if hit in text]
    if name in NOT_YET_MODULES:
        assert old, f"{name} is a module of the suite now: take it off NOT_YET_MODULES"
    else:
        assert old == [], (
            f"{name}: run it as python -m benchmarks.{name[:-3]}, import siblings as "
            "benchmarks.<name>"
        )


def test_no_doc_calls_a_benchmark_as_a_script():
    pattern = re.compile(r"python3? benchmarks/(\w+)\.py")
    docs = [
        ROOT / "README.md",
        ROOT / "Makefile",
        BENCHMARKS / "README.md",
        *ROOT.glob("docs/*.md"),
    ]
    hits = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in docs
        if p.is_file()
        for m in pattern.finditer(p.read_text())
    ]
    assert hits == []


def test_every_figure_row_of_the_readme_table_names_a_record():
    """The "Where each figure comes from" table: a row whose file is under results/ says that a
    record holds it (the other rows name the CLI that prints the figure)."""
    readme = (BENCHMARKS / "README.md").read_text()
    table = readme[readme.index("| figure (section below) |") :].split("\n\n", 1)[0]
    rows = [r for r in table.splitlines()[2:] if r.startswith("|")]
    assert rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if "results/" in cells[2]:
            assert cells[-1] == "record", row
        else:
            assert cells[-1] == "the CLI", row


def _commands(value, found):
    if isinstance(value, dict):
        for key, v in value.items():
            if key == "command" and isinstance(v, str):
                found.append(v)
            else:
                _commands(v, found)
    elif isinstance(value, list):
        for v in value:
            _commands(v, found)
    return found


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_committed_commands_name_no_machine_path(path):
    """No ``command`` in a committed record (the top one or a logged step's) holds an absolute
    path (a temporary folder, a work or home folder): they name the machine that ran, not the run."""
    commands = _commands(json.loads(path.read_text(encoding="utf-8")), [])
    assert commands
    assert [c for c in commands if R.ABSOLUTE.search(c)] == []


def test_a_written_record_names_no_machine_path(tmp_path):
    """write_result rewrites every command: the repository's paths relative, a settings folder
    by its name, any other absolute path as TMP/ + its last component."""
    rec = R.Run("example", settings={"work": "/scratch/w"}, argv=["--work", "/scratch/w"]).finish(
        {"log": [{"command": f"gradmerge merge /scratch/w/a.yaml /tmp/x/out {R.ROOT}/docs"}]}
    )
    written = json.loads(R.write_result(tmp_path / "r.json", rec).read_text())
    assert written["command"] == "python -m benchmarks.example --work WORK"
    assert written["results"]["log"][0]["command"] == "gradmerge merge WORK/a.yaml TMP/out docs"
    assert written["settings"] == {"work": "/scratch/w"}  # the parsed arguments, as they were


def test_a_quick_run_writes_its_record_outside_the_results_unless_asked(tmp_path):
    """record.output: ``--out`` as given; a full run's default (the committed record); a quick
    run's default: a new temporary folder each time, never under benchmarks/results/."""
    default = RESULTS / "example.json"
    assert (
        R.output(tmp_path / "r.json", quick=True, default=default, name="x") == tmp_path / "r.json"
    )
    assert R.output(default, quick=True, default=default, name="x") == default  # asked for
    assert R.output(None, quick=False, default=default, name="x") == default
    first, second = (R.output(None, quick=True, default=default, name="x") for _ in range(2))
    assert first.name == default.name and first.parent != second.parent
    assert first.parent.is_dir() and not any(first.parent.iterdir())
    assert RESULTS not in first.parents and BENCHMARKS not in first.parents
    for path in (first, second):
        path.parent.rmdir()


QUICK_SCRIPTS = sorted(n for n in SCRIPTS if '"--quick"' in (BENCHMARKS / n).read_text())


@pytest.mark.parametrize("name", QUICK_SCRIPTS)
def test_no_quick_mode_writes_into_the_results_by_default(name):
    """Each benchmark with ``--quick`` gives ``--out`` no default under benchmarks/results/ and
    picks its record's path through ``record.output`` (``device_check``: its ``default_out``;
    ``scale --quick`` writes nothing without ``--out``; ``tune_criteria`` requires ``--out``)."""
    text = (BENCHMARKS / name).read_text()
    outs = re.findall(r'add_argument\(\s*"--out",(.*?)\)\n', text, flags=re.S)
    assert outs, f"{name}: no --out option"
    assert not any(re.search(r"default=\s*RESULT", o) for o in outs), name
    chosen = {
        "device_check.py": "args.out or default_out(args.quick)",
        "scale.py": "args.out or (None if args.quick else RESULT)",
        "tune_criteria.py": "required=True",
    }.get(name, "output(")
    assert chosen in text, f"{name}: a --quick run's record must not go into benchmarks/results/"
