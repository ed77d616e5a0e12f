"""The README's result figures are the records': each quoted difference is recomputed from
``benchmarks/results/*.json`` with the sign convention its sentence states (which minus which),
and a range of times spans every record of the same merge. Figures are matched as printed (one
decimal, U+2212 minus), in the README with its line breaks folded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
RESULTS = ROOT / "benchmarks" / "results"


def _results(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())["results"]


def _number(x: float) -> str:
    """A difference in points as the README prints it: +4.8, −0.4, 0.0."""
    text = f"{100 * x:+.1f}"
    return "0.0" if text in ("+0.0", "-0.0") else text.replace("-", "−")


def _paired(d: dict, sign: int = 1) -> str:
    """``difference [low, high]`` in points; ``sign=-1`` for the other order of the subtraction."""
    low, high = sorted(sign * c for c in d["ci95"])
    return f"{_number(sign * d['difference'])} [{_number(low)}, {_number(high)}]"


def _comparison(results: dict, method: str, against: str, **where: object) -> dict:
    (found,) = [
        c
        for c in results["comparisons"]
        if c["method"] == method
        and c["against"] == against
        and all(c.get(k) == v for k, v in where.items())
    ]
    return found


INTERFERENCE = _results("interference-cpu.json")
KFAC = "grad. matching (official), kfac"
TA1 = "task arithmetic α=1"
LABEL_FREE = "task arithmetic, α by tune --criterion loss+base"


def _t4(method: str, against: str) -> dict:
    return _comparison(INTERFERENCE, method, against, T=4)["pooled"]


def test_tasks_that_interfere_one_convention_per_sentence():
    kfac_ta = f"{_paired(_t4(KFAC, TA1))} at α = 1, {_paired(_t4(KFAC, LABEL_FREE))} at the"
    assert f"(K-FAC − task arithmetic: {kfac_ta.replace(' [', ' points [', 1)} label-free α)" in (
        README
    )
    # the record holds other − K-FAC; the sentence says K-FAC − each: the opposite sign
    ties = ", ".join(_paired(_t4(m, KFAC), sign=-1) for m in ("RegMean", "tsv_merge", "iso_c"))
    assert f"with RegMean, TSV-M and Iso-C (K-FAC − each: {ties})" in README
    diag_fisher = ", ".join(
        _paired(_t4(m, LABEL_FREE)) for m in ("grad. matching (official), diag", "Fisher averaging")
    )
    assert f"(each − task arithmetic: {diag_fisher})" in README
    eq15 = _comparison(INTERFERENCE, "grad. matching (Eq. 15 recipe, H_0=δI), kfac", TA1, T=4)[
        "per seed"
    ]
    seeds = ", ".join(_number(s["difference"]) for s in eq15)
    assert f"(K-FAC − task arithmetic α = 1: {seeds} in three seeds)" in README


def test_barely_interfering_rows_each_with_its_paired_interval():
    results = _results("paper-recipe-cpu.json")

    def against_ta(method: str, recipe: str) -> str:
        against = f"task arithmetic ({recipe}), α chosen on validation"
        return _paired(_comparison(results, method, against)["pooled"])

    quoted = (
        f"official diag {against_ta('grad. matching (a) official, diag', 'a')}, "
        f"K-FAC at δ = 1 {against_ta('grad. matching (a) official but δ=1, kfac', 'a')}; "
        f"Eq. 15 diag {against_ta('grad. matching (b) H_0=δI, diag', 'b')}, "
        f"K-FAC {against_ta('grad. matching (b) H_0=δI, kfac', 'b')}"
    )
    assert quoted in README
    paired = {c["method"] for c in results["comparisons"]}
    assert not paired & {"Fisher averaging (a)", "RegMean (a)", "TIES (a), mergekit"}
    assert "no other method is paired there" in README  # ... and the README names none
    spread = results["interference (fine-tuned − task arithmetic (a))"]["mean over seeds"]
    assert f"fine-tuned − task arithmetic ≤ {_number(max(spread.values()))} points" in README


def test_removal_figures_are_the_rows_they_name():
    """The removal sentence: the extended removal record's pooled rows (each − the retrained
    model, on the removed set / on the rest) and their costs, and remerge's from the study."""
    removal = _results("interference-removal-cpu.json")
    rows = {r["method"]: r for r in removal["removal comparisons"]}

    def on(name: str, part: str, paired: bool = False) -> str:
        d = rows[name][f"{part}: model − gold"]
        return _paired(d) if paired else _number(d["difference"])

    def cost(name: str) -> str:
        from benchmarks.interference import pool_keys

        fractions = {
            round(100 * r["cost"]["fraction of retraining"])
            for s in removal["removal"]
            for r in s["rows"]
            if name in pool_keys(r) and "cost" in r
        }
        (only,) = fractions
        return f"{only}%"

    neg = "baseline | NegGrad+, 10% of retraining"
    assert len(removal["seeds"]) == 3 and f"{len(removal['seeds'])} seeds" in README
    assert rows[neg]["seeds"] == 3 and cost(neg) == "10%"
    assert (
        f"**NegGrad+** at 10%, {on(neg, 'removed', True)} (chance) and {on(neg, 'remaining', True)}"
        in README
    )
    eq13 = "from M | Eq. 13, kfac, label-free δ"
    refined = "from M | Eq. 13, kfac, agreement δ + refine 2"
    assert (
        f"label-free δ: {on(eq13, 'removed')} / {on(eq13, 'remaining')} at {cost(eq13)}, "
        f"refined {on(refined, 'removed')} / {on(refined, 'remaining')}"
    ) in README
    rest = "baseline | fine-tune M on the rest, 10% of retraining"
    assert f"fine-tuning on the rest: {on(rest, 'removed')}" in README
    # the second removed set, which needed no removal: NegGrad+'s loss on it
    sentences = _results("interference-removal-sentences-cpu.json")
    (neg_s,) = [r for r in sentences["removal comparisons"] if r["method"] == neg]
    assert f"{_number(neg_s['removed: model − gold']['difference'])} on a set that needed" in README
    remerge = {r["method"]: r for r in INTERFERENCE["removal comparisons"]}["from merge | remerge"]
    assert (
        f"`remerge` of a merge: {_paired(remerge['remaining: model − gold'])} on the rest" in README
    )


def test_the_gpt2_time_range_spans_every_record_of_the_merge():
    """2 tasks × 2,048 tokens, δ = 6, the default solver (certified to 1e-5): the tolerance
    study's default and bfloat16 rows (the same computation) and the first run's exact merge."""
    rows = {r["setting"]: r["wall_seconds"] for r in _results("kfac-tolerance-cpu.json")["rows"]}
    merges = _results("gpt2-kfac-cpu.json")["merges"]
    walls = [
        rows["tol=1e-05"],
        rows["tol=1e-05, bfloat16 products"],
        merges["K-FAC gradient matching T=2 delta=6"]["wall_seconds"],
    ]
    quoted = f"2 tasks × 2,048 tokens {min(walls):.0f}–{max(walls):.0f} s ({len(walls)} runs)"
    assert quoted.replace("(3 runs)", "(three runs)") in README


@pytest.mark.parametrize(
    "page", ["README.md", "benchmarks/README.md", "docs", "gradmerge", "theory"]
)
def test_no_internal_issue_number_where_a_reader_looks(page):
    """Issue numbers of this project's tracker mean nothing to a reader (another project's, named
    with it, do: "mergekit ... its issue 549")."""
    import re

    paths = [ROOT / page] if page.endswith(".md") else sorted((ROOT / page).rglob("*.[mp][dy]"))
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\b[Ii]ssues? #?\d+", line) and "mergekit" not in line:
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []
