"""The `gradmerge verify` command: its table, its JSON, and its exit status."""

import json

import pytest

from gradmerge import cli
from gradmerge.theory import verify
from gradmerge.theory.numeric import ALL_CHECKS
from gradmerge.theory.numeric._common import NumericCheck
from gradmerge.theory.numeric.cases import LinearMergeSpec


def _few_checks(monkeypatch, extra=()):
    """Keep the command fast: the symbolic checks have their own tests."""
    monkeypatch.setattr(verify, "SYMBOLIC_CHECKS", [])
    chosen = [
        c
        for c in ALL_CHECKS
        if c.id in ("eq6-exact-quadratic", "line37-removed-printed", "line37-removed-corrected")
    ]
    monkeypatch.setattr(verify, "NUMERIC_CHECKS", [*chosen, *extra])


def test_verify_prints_rows_and_writes_json(tmp_path, monkeypatch, capsys):
    _few_checks(monkeypatch)
    out = tmp_path / "verify.json"
    assert cli.main(["verify", "--seeds", "2", "--study", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "eq6-exact-quadratic" in text and "erratum" in text and "0 failed" in text
    rows = {r["id"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["eq6-exact-quadratic"]["verdict"] == "holds"
    assert rows["eq6-exact-quadratic"]["numeric_max_error"] < 1e-9
    assert rows["line37-removed-printed"]["verdict"] == "erratum"


def test_verify_fails_when_a_statement_that_should_hold_fails(monkeypatch, capsys):
    def wrong(spec: LinearMergeSpec) -> float:
        return 1.0

    broken = NumericCheck("broken", "line 1", "a statement that does not hold", True, wrong)
    _few_checks(monkeypatch, [broken])
    assert cli.main(["verify", "--seeds", "1", "--study", "0"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_verify_fails_when_an_erratum_unexpectedly_holds(monkeypatch):
    def holds(spec: LinearMergeSpec) -> float:
        return 0.0

    fake = NumericCheck("fake-printed", "line 1", "claimed wrong, but holds", False, holds)
    _few_checks(monkeypatch, [fake])
    assert cli.main(["verify", "--seeds", "1", "--study", "0"]) == 1


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["verify", "--seeds", "0"])
    assert "gradmerge verify: error: --seeds must be at least 1" in capsys.readouterr().err
    assert cli.main([]) == 0  # bare `gradmerge`: the help (test_cli_start.py)
    assert capsys.readouterr().out.startswith("usage: gradmerge")
