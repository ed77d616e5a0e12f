"""Run every derivation check of the appendix and tabulate the verdicts (``gradmerge verify``).

Rows join the symbolic check (:mod:`gradmerge.theory.symbolic`) and the numeric check
(:mod:`gradmerge.theory.numeric`) of the same statement by id. A row's verdict:

- ``holds``: a statement that should hold, and every check of it passed;
- ``erratum``: a statement as printed that is wrong, and every check of it showed it failing;
- ``FAILED``: anything else — a bug in the package, the models, or the checks.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from gradmerge.theory.numeric import ALL_CHECKS as NUMERIC_CHECKS
from gradmerge.theory.numeric._common import NumericCheck
from gradmerge.theory.symbolic import ALL_CHECKS as SYMBOLIC_CHECKS
from gradmerge.theory.symbolic._check import SymbolicCheck

# where each numbered equation sits in the appendix (for ordering rows)
_EQ_LINE = {1: 7, 2: 8, 3: 12, 4: 13, 5: 14, 6: 16, 7: 18, 8: 19, 9: 20, 10: 22, 11: 24, 12: 27}
_EQ_LINE |= {13: 30, 14: 39, 15: 41, 16: 45, 17: 57, 18: 58, 19: 64, 20: 70, 21: 84}


@dataclass
class Row:
    """One statement: what each check found, and the verdict."""

    id: str
    where: str
    statement: str
    expect: bool
    symbolic: bool | None = None  # identity holds symbolically (None: no symbolic check)
    numeric_max_error: float | None = None  # largest error over the cases
    numeric_min_error: float | None = None
    numeric_cases: int = 0
    numeric_tol: float | None = None
    model: str | None = None
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        sym_ok = self.symbolic is None or self.symbolic is self.expect
        if self.numeric_max_error is None:
            num_ok = True
        elif self.expect:
            num_ok = self.numeric_max_error <= (self.numeric_tol or 0.0)
        else:
            num_ok = (self.numeric_min_error or 0.0) > (self.numeric_tol or 0.0)
        if not (sym_ok and num_ok):
            return "FAILED"
        return "holds" if self.expect else "erratum"


def _line_of(where: str) -> float:
    """The appendix line a row is about: the largest "line N" named, else its equation's line."""
    lines = [int(n) for n in re.findall(r"lines?\s+(\d+)", where)]
    if lines:
        return float(max(lines))
    eq = re.search(r"Eq\.\s*(\d+)", where)
    return float(_EQ_LINE.get(int(eq.group(1)), 999)) if eq else 999.0


def _printed_first(row_id: str) -> str:
    return row_id.replace("-printed", "-0").replace("-corrected", "-1")


def collect(
    seeds: int = 10,
    *,
    symbolic: Iterable[SymbolicCheck] | None = None,
    numeric: Iterable[NumericCheck] | None = None,
) -> list[Row]:
    """Run the checks (numeric ones on ``seeds`` random cases each) and join them by id.

    ``symbolic`` and ``numeric`` default to every check of :mod:`gradmerge.theory.symbolic` and
    :mod:`gradmerge.theory.numeric`.
    """
    symbolic = SYMBOLIC_CHECKS if symbolic is None else symbolic
    numeric = NUMERIC_CHECKS if numeric is None else numeric
    rows: dict[str, Row] = {}
    for sym in symbolic:
        start = time.perf_counter()
        row = rows.setdefault(sym.id, Row(sym.id, sym.where, sym.statement, sym.expect))
        row.symbolic = bool(sym.run())
        row.seconds += time.perf_counter() - start
    for check in numeric:
        start = time.perf_counter()
        row = rows.setdefault(check.id, Row(check.id, check.where, check.statement, check.expect))
        if row.expect is not check.expect:
            raise ValueError(f"symbolic and numeric checks of {check.id!r} disagree on `expect`")
        errors = [check.error(seed) for seed in range(seeds)]
        worst = (
            max(errors) if row.numeric_max_error is None else max(row.numeric_max_error, *errors)
        )
        best = min(errors) if row.numeric_min_error is None else min(row.numeric_min_error, *errors)
        row.numeric_max_error, row.numeric_min_error = worst, best
        row.numeric_cases += len(errors)
        row.numeric_tol = check.tol
        row.model = check.model if row.model in (None, check.model) else "both"
        row.seconds += time.perf_counter() - start
    return sorted(rows.values(), key=lambda r: (_line_of(r.where), _printed_first(r.id)))


def format_table(rows: list[Row]) -> str:
    """A fixed-width table, one row per statement."""
    head = ("id", "where", "statement", "symbolic", "numeric error", "verdict")
    body = []
    for r in rows:
        sym = "—" if r.symbolic is None else ("holds" if r.symbolic else "fails")
        if r.numeric_max_error is None:
            num = "—"
        elif r.expect:
            num = f"max {r.numeric_max_error:.1e} ({r.model}, {r.numeric_cases})"
        else:
            num = f"min {r.numeric_min_error:.1e} ({r.model}, {r.numeric_cases})"
        body.append((r.id, r.where, r.statement, sym, num, r.verdict))
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    widths[2] = min(widths[2], 60)

    def fmt(cells: tuple[str, ...]) -> str:
        cells = tuple(
            c if len(c) <= w else c[: w - 1] + "…" for c, w in zip(cells, widths, strict=True)
        )
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return "\n".join([fmt(head), "  ".join("-" * w for w in widths), *map(fmt, body)])


def summary(rows: list[Row]) -> str:
    holds = sum(r.verdict == "holds" for r in rows)
    errata = sum(r.verdict == "erratum" for r in rows)
    failed = [r.id for r in rows if r.verdict == "FAILED"]
    text = (
        f"{holds} statements hold; {errata} printed statements are wrong as printed (errata, "
        f"each with a corrected statement that holds); {len(failed)} failed"
    )
    return text + (f": {', '.join(failed)}" if failed else ".")


def as_json(rows: list[Row]) -> list[dict]:
    return [asdict(r) | {"verdict": r.verdict} for r in rows]
