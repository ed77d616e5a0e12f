"""theory/ and the checks stay in step: every symbolic and numeric check of the appendix is named on
a ``Checks:`` line of a document in theory/, and every id such a line names is a registered check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("sympy")

from gradmerge.theory.numeric import linear_checks, logistic_checks
from gradmerge.theory.symbolic import ALL_CHECKS

ROOT = Path(__file__).resolve().parents[2]
THEORY = ROOT / "theory"


def _named() -> dict[str, list[str]]:
    """Check ids named on ``Checks:`` lines, with the documents naming them."""
    named: dict[str, list[str]] = {}
    for page in sorted(THEORY.glob("*.md")):
        for line in page.read_text(encoding="utf-8").splitlines():
            if line.startswith("Checks:"):
                for ident in re.findall(r"`([^`]+)`", line):
                    named.setdefault(ident, []).append(page.name)
    return named


def _registered() -> set[str]:
    ids = {c.id for c in ALL_CHECKS}
    for module in (linear_checks, logistic_checks):
        ids |= {c.id for c in module.CHECKS}
    return ids


def test_theory_is_a_folder_of_documents_not_a_package():
    assert (THEORY / "README.md").is_file() and (THEORY / "ERRATA.md").is_file()
    assert not list(THEORY.glob("*.py")), "theory/ is for reading; the checks live in gradmerge"


def test_every_check_is_named_in_a_document():
    missing = sorted(_registered() - set(_named()))
    assert not missing, f"checks no document in theory/ names on a 'Checks:' line: {missing}"


def test_every_named_id_is_a_check():
    unknown = {i: pages for i, pages in _named().items() if i not in _registered()}
    assert not unknown, f"ids named in theory/ that no check has: {unknown}"
